"""Plain data: the only thing that leaves a graded kernel, and how it is read back outside.

A test cell's probe runs in the student's kernel and assigns names; ``publish`` (run in that
kernel after the probe) sends the values its check reads as JSON. Nothing sent is trusted:
the kernel may have been changed in any way, so ``decode`` (run in the grader's checker, a
fresh interpreter) builds every value anew from JSON, of exact built-in types, and refuses
anything else. No pickle and no code crosses: an object whose ``__eq__`` always agrees, a
subclass of float or list or Tensor, or a function cannot arrive, only what they hold.

What may cross: None, bool, int, float (nan and inf too), str, and lists, tuples, sets and
dicts of them (keys of any hashable plain type), torch tensors and numpy arrays of numeric or
bool dtype (sent as their raw bytes, rebuilt from them), numpy scalars (as Python numbers).
"""

from __future__ import annotations

import base64
import json
import math
import sys

MIME = "application/vnd.course.probe+json"
MAX_BYTES = 32 * 2**20  # one probe's data, encoded
MAX_DEPTH = 64
DTYPES = (
    "bool",
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "complex64",
    "complex128",
)


class NotPlain(ValueError):
    """A value that is not plain data (or data that does not decode to plain values)."""


# -- in the kernel: encode ---------------------------------------------------------------------


def encode(value, where: str = "value", depth: int = 0):
    """``value`` as JSON-able data; raises NotPlain saying where and what it met."""
    if depth > MAX_DEPTH:
        raise NotPlain(f"{where} is nested deeper than {MAX_DEPTH} levels")
    kind = type(value)
    if value is None or kind in (bool, int, str):
        return value
    if kind is float:
        return value if math.isfinite(value) else {"$": "float", "v": repr(value)}
    if kind is list:
        return [encode(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value)]
    if kind is tuple:
        return {
            "$": "tuple",
            "v": [encode(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value)],
        }
    if kind in (set, frozenset):
        return {"$": "set", "v": [encode(v, f"{where} item", depth + 1) for v in value]}
    if kind is dict:
        return {
            "$": "dict",
            "v": [
                [encode(k, f"{where} key", depth + 1), encode(v, f"{where}[{k!r}]", depth + 1)]
                for k, v in value.items()
            ],
        }
    torch, np = sys.modules.get("torch"), sys.modules.get("numpy")
    if torch is not None and kind in (torch.Tensor, torch.nn.Parameter):
        t = value.detach().cpu().contiguous()
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype not in DTYPES:
            raise NotPlain(f"{where} is a tensor of dtype {dtype}, not one of {', '.join(DTYPES)}")
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return {"$": "tensor", "dtype": dtype, "shape": list(t.shape), "data": _b64(raw)}
    if np is not None and kind is np.ndarray:
        if value.dtype.name not in DTYPES:
            raise NotPlain(
                f"{where} is an array of dtype {value.dtype}, not one of {', '.join(DTYPES)}"
            )
        raw = value.astype(value.dtype.newbyteorder("<"), copy=False).tobytes(order="C")
        return {
            "$": "ndarray",
            "dtype": value.dtype.name,
            "shape": list(value.shape),
            "data": _b64(raw),
        }
    if np is not None and isinstance(value, np.generic) and kind.__module__ == "numpy":
        return encode(value.item(), where, depth)  # a numpy scalar: the Python number it holds
    if torch is not None and kind is torch.Size:
        return encode(tuple(value), where, depth)
    raise NotPlain(
        f"{where} is a {kind.__module__}.{kind.__qualname__}, not plain data (None, bool, int, "
        "float, str, list, tuple, set, dict, a tensor or an array)"
    )


def _torch():
    import torch

    return torch


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def forget(names: list[str]) -> None:
    """In the kernel, before a probe: drop ``names``, so only what the probe assigns is sent."""
    from IPython import get_ipython

    ns = get_ipython().user_ns
    for name in names:
        ns.pop(name, None)


def publish(names: list[str]) -> None:
    """In the kernel, after a probe: send the values of ``names`` (missing and refused noted)."""
    from IPython import get_ipython
    from IPython.display import publish_display_data

    ns = get_ipython().user_ns
    out = {"values": {}, "missing": [], "refused": {}}
    for name in names:
        if name not in ns:
            out["missing"].append(name)
            continue
        try:
            out["values"][name] = encode(ns[name], name)
        except NotPlain as exc:
            out["refused"][name] = str(exc)
    text = json.dumps(out)
    if len(text) > MAX_BYTES:
        text = json.dumps({"error": f"the probe's data is {len(text):,} bytes, over {MAX_BYTES:,}"})
    publish_display_data({MIME: text})


# -- outside: decode ----------------------------------------------------------------------------


def decode_probe(text: str) -> dict:
    """The namespace a check starts from, from what ``publish`` sent; NotPlain if anything is off."""
    if not isinstance(text, str) or len(text) > MAX_BYTES:
        raise NotPlain("the probe's data is missing or too large")
    try:
        obj = json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:
        raise NotPlain(f"the probe's data is not valid JSON ({str(exc)[:80]})") from None
    if type(obj) is not dict:
        raise NotPlain("the probe's data is not a JSON object")
    if "error" in obj:
        raise NotPlain(str(obj["error"])[:300])
    values, missing, refused = obj.get("values"), obj.get("missing"), obj.get("refused")
    if type(values) is not dict or type(missing) is not list or type(refused) is not dict:
        raise NotPlain("the probe's data lacks values, missing or refused")
    if refused:
        name, why = next(iter(refused.items()))
        raise NotPlain(str(why)[:300] if type(why) is str else f"{name} is not plain data")
    if missing:
        raise NotPlain(f"the probe did not assign {', '.join(map(str, missing))[:200]}")
    return {str(name): decode(v, str(name)) for name, v in values.items()}


def _no_constant(name):
    raise ValueError(f"{name} is not allowed (floats that are not finite are tagged)")


def decode(obj, where: str = "value", depth: int = 0):
    """A fresh plain value from JSON data made by ``encode``; NotPlain for anything else."""
    if depth > MAX_DEPTH:
        raise NotPlain(f"{where} is nested deeper than {MAX_DEPTH} levels")
    kind = type(obj)
    if obj is None or kind in (bool, int, str, float):
        return obj
    if kind is list:
        return [decode(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(obj)]
    if kind is not dict or type(obj.get("$")) is not str:
        raise NotPlain(f"{where}: {kind.__name__} data that encode() never makes")
    tag = obj["$"]
    try:
        if tag == "float" and obj["v"] in ("nan", "inf", "-inf"):
            return float(obj["v"])
        if tag == "tuple":
            return tuple(decode(v, where, depth + 1) for v in _list(obj["v"]))
        if tag == "set":
            return {decode(v, where, depth + 1) for v in _list(obj["v"])}
        if tag == "dict":
            out = {}
            for pair in _list(obj["v"]):
                k, v = _list(pair)
                out[decode(k, f"{where} key", depth + 1)] = decode(v, f"{where}[..]", depth + 1)
            return out
        if tag in ("tensor", "ndarray"):
            return _array(obj, tag, where)
    except (KeyError, TypeError, ValueError) as exc:  # unhashable keys, wrong pairs, bad numbers
        raise NotPlain(
            f"{where}: malformed {tag} ({type(exc).__name__}: {str(exc)[:80]})"
        ) from None
    raise NotPlain(f"{where}: unknown tag {tag[:40]!r}")


def _list(v) -> list:
    if type(v) is not list:
        raise TypeError("expected a list")
    return v


def _array(obj: dict, tag: str, where: str):
    """A tensor or array rebuilt from raw bytes, dtype (from the allowlist) and shape."""
    import numpy as np

    dtype, shape, data = obj["dtype"], _list(obj["shape"]), obj["data"]
    if dtype not in DTYPES or type(data) is not str:
        raise ValueError(f"dtype {str(dtype)[:20]} is not allowed")
    if not all(type(n) is int and n >= 0 for n in shape):
        raise ValueError("the shape must be a list of sizes")
    raw = base64.b64decode(data, validate=True)
    count = math.prod(shape)
    if tag == "tensor":
        torch = _torch()
        kind = getattr(torch, dtype)
        size = torch.empty((), dtype=kind).element_size()
        if len(raw) != count * size:
            raise ValueError(f"{len(raw)} bytes for {count} elements of {size}")
        flat = (
            torch.frombuffer(bytearray(raw), dtype=torch.uint8)
            if raw
            else torch.empty(0, dtype=torch.uint8)
        )
        return flat.view(kind).reshape(shape).clone()
    if dtype == "bfloat16":
        raise ValueError("numpy has no bfloat16")
    kind = np.dtype(dtype).newbyteorder("<")
    if len(raw) != count * kind.itemsize:
        raise ValueError(f"{len(raw)} bytes for {count} elements of {kind.itemsize}")
    return np.frombuffer(raw, dtype=kind).reshape(shape).astype(kind.newbyteorder("="), copy=True)
