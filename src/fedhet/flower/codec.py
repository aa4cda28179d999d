"""fedhet values <-> Flower records, losslessly.

* A *tree* is any nested value: dicts/lists/tuples of tensors, Python scalars, bytes and None
  (client state, the server state sent for evaluation, messages). Its skeleton is JSON with
  tensor placeholders (``<prefix>.tree``) and its tensors are one ArrayRecord
  (``<prefix>.tensors``); a tensor referenced twice travels once. Dicts whose keys are not all
  strings (FedCME's per-client vectors keyed by int) keep their key types.
* A *batch* is several clients' :class:`fedhet.core.contract.Message` s of one round as one
  tree, plus the ConfigRecord ``"fedhet"`` (client ids, round): one node's share of a phase,
  or its replies. The global model that every client of a phase gets crosses the wire once.

Tensors travel as Flower ``Array``s (raw bytes + dtype + shape), so ``torch.equal`` holds after a
round trip; floats in JSON use Python's shortest round-tripping repr, so they are exact too.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import numpy as np
import torch

from fedhet.core.contract import Message
from fedhet.flower import require_flower

require_flower()

from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict  # noqa: E402


# --- tensors --------------------------------------------------------------------------------
def to_array(t: torch.Tensor) -> Array:
    if t.dtype == torch.bfloat16:
        # numpy has no bfloat16; fedhet keeps weights in fp32 (TrainSettings.precision), so
        # this only happens with a method that stores bf16 tensors itself.
        raise TypeError("cannot send a bfloat16 tensor over Flower; convert it to float32 first")
    return Array(t.detach().cpu().contiguous().numpy())


def from_array(a: Array) -> torch.Tensor:
    # Copy: the deserialised buffer is read-only, and algorithms may update tensors in place.
    return torch.from_numpy(np.array(a.numpy(), copy=True))


def arrays_to_record(arrays: dict[str, torch.Tensor]) -> ArrayRecord:
    bad = [k for k, v in arrays.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise TypeError(f"message array groups hold tensors only; {bad[0]!r} is a {type(arrays[bad[0]]).__name__}")
    return ArrayRecord({k: to_array(v) for k, v in arrays.items()})


def record_to_arrays(record: ArrayRecord) -> dict[str, torch.Tensor]:
    return {k: from_array(v) for k, v in record.items()}


# --- trees ----------------------------------------------------------------------------------
def _encode(obj: Any, tensors: dict[str, torch.Tensor], seen: dict[int, str]) -> Any:
    if isinstance(obj, torch.Tensor):
        key = seen.get(id(obj))            # a tensor referenced twice is sent once
        if key is None:
            key = seen[id(obj)] = f"t{len(tensors)}"
            tensors[key] = obj
        return {"__tensor__": key}
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, bytes):
        return {"__bytes__": base64.b64encode(obj).decode("ascii")}
    if isinstance(obj, int):
        return obj
    if isinstance(obj, float):
        return obj
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return {"__ndarray__": _encode(torch.from_numpy(obj), tensors, seen)}
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: _encode(v, tensors, seen) for k, v in obj.items()}
        return {"__dict__": [[_encode(k, tensors, seen), _encode(v, tensors, seen)] for k, v in obj.items()]}
    if isinstance(obj, list):
        return [_encode(v, tensors, seen) for v in obj]
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(v, tensors, seen) for v in obj]}
    raise TypeError(f"cannot send a {type(obj).__name__} over Flower: client state and message scalars hold "
                    "tensors, numbers, strings, None and lists/dicts/tuples of them")


def _decode(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if len(obj) == 1:
        (tag, value), = obj.items()
        if tag == "__tensor__":
            return tensors[value]
        if tag == "__ndarray__":
            return _decode(value, tensors).numpy()
        if tag == "__tuple__":
            return tuple(_decode(v, tensors) for v in value)
        if tag == "__bytes__":
            return base64.b64decode(value)
        if tag == "__dict__":
            return {_freeze(_decode(k, tensors)): _decode(v, tensors) for k, v in value}
    return {k: _decode(v, tensors) for k, v in obj.items()}


def _freeze(key: Any) -> Any:
    return tuple(key) if isinstance(key, list) else key


def encode_tree(obj: Any) -> tuple[str, dict[str, torch.Tensor]]:
    """``(skeleton JSON, {placeholder: tensor})`` of a nested value."""
    tensors: dict[str, torch.Tensor] = {}
    skeleton = json.dumps(_encode(obj, tensors, {}))
    return skeleton, tensors


def decode_tree(skeleton: str, tensors: dict[str, torch.Tensor]) -> Any:
    return _decode(json.loads(skeleton), tensors)


def tree_to_records(obj: Any, rd: RecordDict, prefix: str) -> None:
    """Store a tree as ``<prefix>.tree`` (ConfigRecord) + ``<prefix>.tensors`` (ArrayRecord)."""
    skeleton, tensors = encode_tree(obj)
    rd[f"{prefix}.tree"] = ConfigRecord({"json": skeleton})
    rd[f"{prefix}.tensors"] = arrays_to_record(tensors)


def tree_from_records(rd: RecordDict, prefix: str, default: Any = None) -> Any:
    if f"{prefix}.tree" not in rd:
        return default
    return decode_tree(rd[f"{prefix}.tree"]["json"], record_to_arrays(rd[f"{prefix}.tensors"]))


def drop_tree(rd: RecordDict, prefix: str) -> None:
    for key in (f"{prefix}.tree", f"{prefix}.tensors"):
        if key in rd:
            del rd[key]


# --- messages -------------------------------------------------------------------------------
def encode_batch(messages: dict[int, Message], rnd: int, prefix: str = "batch") -> RecordDict:
    """Several clients' messages of one round in one RecordDict (one node's share of a phase, or
    its replies). They are one tree, so a tensor that several messages hold (the global model
    every client of the phase gets) crosses the wire once."""
    rd = RecordDict({"fedhet": ConfigRecord({"cids": [int(c) for c in messages], "round": int(rnd)})})
    tree_to_records([{"kind": m.kind, "arrays": m.arrays, "scalars": m.scalars} for m in messages.values()],
                    rd, prefix)
    return rd


def decode_batch(rd: RecordDict, prefix: str = "batch") -> tuple[dict[int, Message], int]:
    """``({cid: message}, round)`` from :func:`encode_batch`'s RecordDict. Messages that shared
    a tensor share it again (as in the simulator, where every client gets the server's tensors)."""
    head = rd["fedhet"]
    items = tree_from_records(rd, prefix, [])
    cids = [int(c) for c in head["cids"]]
    if len(items) != len(cids):
        raise ValueError(f"a batch of {len(cids)} client ids carries {len(items)} messages")
    return {c: Message(m["kind"], m["arrays"], m["scalars"]) for c, m in zip(cids, items)}, int(head["round"])


def head_of(rd: RecordDict) -> ConfigRecord:
    return rd["fedhet"]


def message_type(kind: str) -> str:
    """Flower message type of a fedhet message kind: ``"train"`` for the first phase's
    ``"train"``, ``"train.<kind>"`` for the others (FedCME's ``"train.exchange"``); Flower
    routes on it and logs it (flwr.app.message_type: ``<category>.<python identifier>``)."""
    if kind == "train" or not kind.isidentifier():
        return "train"
    return f"train.{kind}"
