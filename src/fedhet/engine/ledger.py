"""Communication ledger: floats and bytes by direction and message group, per round and in total.

Groups named ``eval_*`` (FedBABU's fine-tuning and Per-FedAvg's adaptation send ``eval_model``
to the clients an evaluation tests) are evaluation-only traffic: listed by group like any other,
and summed apart under ``evaluation``, not in the ``up`` and ``down`` totals, which compare what
methods send to train (no other method's evaluation is counted: its clients evaluate what they
already hold)."""

from __future__ import annotations

from collections import defaultdict

from fedhet.core.contract import Message

EVALUATION_ONLY = "eval_"      # group-name prefix of evaluation-only traffic


class CommLedger:
    """Totals for the whole run plus the rounds not yet taken out with :meth:`take_round`."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.total: dict[str, list[int]] = defaultdict(lambda: [0, 0])   # "down/model" -> [floats, bytes]
        self.by_round: dict[int, dict[str, list[int]]] = defaultdict(lambda: defaultdict(lambda: [0, 0]))

    def record(self, rnd: int, direction: str, msg: Message) -> None:
        for group, (floats, nbytes) in msg.payload().items():
            key = f"{direction}/{group}"
            for table in (self.total, self.by_round[rnd]):
                table[key][0] += floats
                table[key][1] += nbytes

    def take_round(self, rnd: int) -> dict[str, dict[str, int]]:
        """Round ``rnd``'s traffic by direction/group; forgotten afterwards (the totals keep it)."""
        table = self.by_round.pop(rnd, {})
        return {k: {"floats": v[0], "bytes": v[1]} for k, v in sorted(table.items())}

    def totals(self) -> dict[str, dict[str, int]]:
        out = {k: {"floats": v[0], "bytes": v[1]} for k, v in sorted(self.total.items())}

        def summed(keys: list[str]) -> dict[str, int]:
            return {"floats": sum(self.total[k][0] for k in keys), "bytes": sum(self.total[k][1] for k in keys)}

        evaluation = [k for k in self.total if k.split("/", 1)[1].startswith(EVALUATION_ONLY)]
        for direction in ("up", "down"):
            out[direction] = summed([k for k in self.total if k.startswith(direction + "/") and k not in evaluation])
        if evaluation:
            out["evaluation"] = summed(evaluation)
        return out

    def state_dict(self) -> dict:
        # Checkpoints are written between rounds, when no round is pending: the totals are the state.
        return {"total": dict(self.total)}

    def load_state_dict(self, state: dict) -> None:
        self.reset()
        for k, v in state["total"].items():
            self.total[k] = list(v)


def tensor_floats(obj) -> int:
    """Number of tensor elements held anywhere inside ``obj`` (nested dicts/lists of tensors)."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.numel()
    if hasattr(obj, "tensor_floats"):      # ClientStates: counted without loading the states spilled to disk
        return int(obj.tensor_floats())
    if isinstance(obj, dict):
        return sum(tensor_floats(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_floats(v) for v in obj)
    return 0
