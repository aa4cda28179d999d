"""fedhet values <-> Flower records, losslessly.

* A :class:`fedhet.algorithms.base.Message` becomes a RecordDict: each ``arrays`` group is one
  ArrayRecord (``"arrays.<group>"``, the unit docs/architecture.md names), the scalars Flower
  can hold (bool, int, float, str, bytes) go in the ConfigRecord ``"scalars"``, everything else
  (``None``, lists, dicts, numpy values) is JSON in ``"scalars.json"``, and the ConfigRecord
  ``"fedhet"`` carries the kind, the fedhet client id, the round and the key orders.
* Any other value (client state, the server state sent for evaluation) is a *tree*: nested
  dicts/lists/tuples of tensors and Python scalars. Its skeleton is JSON with tensor
  placeholders and its tensors are one ArrayRecord. Dicts whose keys are not all strings
  (FedCME's per-client vectors keyed by int) keep their key types.

Tensors travel as Flower ``Array``s (raw bytes + dtype + shape), so ``torch.equal`` holds after a
round trip; floats in JSON use Python's shortest round-tripping repr, so they are exact too.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch

from fedhet.core.contract import Message
from fedhet.flower import require_flower

require_flower()

from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict  # noqa: E402

# ConfigRecord holds these natively; bool is checked first because it is an int subclass.
_NATIVE = (bool, int, float, str, bytes)
_INT64 = (-(2**63), 2**63 - 1)


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
def _native(v: Any) -> bool:
    if isinstance(v, int) and not isinstance(v, bool):
        return _INT64[0] <= v <= _INT64[1]
    return isinstance(v, _NATIVE)


def encode_message(msg: Message, cid: int, rnd: int, extra: dict[str, Any] | None = None) -> RecordDict:
    """A fedhet message for (or from) client ``cid`` in round ``rnd`` (0-based) as a RecordDict."""
    rd = RecordDict()
    native = {k: v for k, v in msg.scalars.items() if _native(v)}
    other = {k: v for k, v in msg.scalars.items() if k not in native}
    head = {"kind": msg.kind, "cid": int(cid), "round": int(rnd),
            "groups": json.dumps(list(msg.arrays)), "scalar-order": json.dumps(list(msg.scalars))}
    rd["fedhet"] = ConfigRecord({**head, **(extra or {})})
    for group, arrays in msg.arrays.items():
        if not isinstance(arrays, dict):
            raise TypeError(f"message group {group!r} of a {msg.kind!r} message is a {type(arrays).__name__}, "
                            "not a dict of tensors")
        rd[f"arrays.{group}"] = arrays_to_record(arrays)
    rd["scalars"] = ConfigRecord(native)
    if other:
        tree_to_records(other, rd, "scalars.other")
    return rd


def decode_message(rd: RecordDict) -> tuple[Message, int, int]:
    """``(message, cid, round)`` from :func:`encode_message`'s RecordDict."""
    head = rd["fedhet"]
    arrays = {g: record_to_arrays(rd[f"arrays.{g}"]) for g in json.loads(head["groups"])}
    scalars = dict(rd["scalars"])
    scalars.update(tree_from_records(rd, "scalars.other", {}))
    order = json.loads(head["scalar-order"])
    return Message(str(head["kind"]), arrays, {k: scalars[k] for k in order}), int(head["cid"]), int(head["round"])


def head_of(rd: RecordDict) -> ConfigRecord:
    return rd["fedhet"]


def message_type(kind: str) -> str:
    """Flower message type of a fedhet message kind: ``"train"`` for the first phase's
    ``"train"``, ``"train.<kind>"`` for the others (FedCME's ``"train.exchange"``); Flower
    routes on it and logs it (flwr.app.message_type: ``<category>.<python identifier>``)."""
    if kind == "train" or not kind.isidentifier():
        return "train"
    return f"train.{kind}"
