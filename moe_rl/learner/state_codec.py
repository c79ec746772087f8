"""Store nested training state (state dicts, RNG states) as safetensors + a JSON skeleton, no pickle.

Owns the encoding: every tensor / numpy array / bytes blob in a tree of dicts, lists and tuples is
replaced in the skeleton by a reference to a named entry of one safetensors file; everything else
must be a JSON scalar (None, bool, int, float, str). Any other object is refused at save time with
its path in the tree, so nothing a loader would have to unpickle can ever be written, and loading
never executes code (safetensors headers and JSON only).
"""

from __future__ import annotations

import io
import json
import os
import re
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save, save_file

__all__ = ["SKELETON_KEY", "StateCodecError", "load_state", "save_state", "state_bytes"]

SKELETON_KEY = "moe_rl_state"  # safetensors metadata entry holding the JSON skeleton


class StateCodecError(ValueError):
    """A state holds an object that cannot be stored without pickle, or a file is not a valid state."""


def _encode(obj, path: str, tensors: dict[str, torch.Tensor], seen: set[int]):
    if isinstance(obj, torch.Tensor):
        key = f"t{len(tensors)}"
        t = obj.detach().to("cpu")
        ptr = t.untyped_storage().data_ptr() if t.numel() else None
        partial = t.numel() * t.element_size() != t.untyped_storage().nbytes()
        if not t.is_contiguous() or ptr in seen or partial:
            t = t.contiguous().clone()  # safetensors refuses shared or partial storage
        if ptr is not None:
            seen.add(t.untyped_storage().data_ptr())
        tensors[key] = t
        return {"__tensor__": key}
    if isinstance(obj, np.ndarray):
        key = f"t{len(tensors)}"
        tensors[key] = torch.as_tensor(np.ascontiguousarray(obj), device="cpu").clone()
        return {"__ndarray__": key}
    if isinstance(obj, (bytes, bytearray, io.BytesIO)):
        raw = obj.getvalue() if isinstance(obj, io.BytesIO) else bytes(obj)
        key = f"t{len(tensors)}"
        tensors[key] = (
            torch.frombuffer(bytearray(raw), dtype=torch.uint8)
            if raw
            else torch.zeros(0, dtype=torch.uint8, device="cpu")
        )
        return {"__bytesio__" if isinstance(obj, io.BytesIO) else "__bytes__": key}
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: _encode(v, f"{path}.{k}", tensors, seen) for k, v in obj.items()}
        items = []
        for k, v in obj.items():
            if not isinstance(k, (str, int)) or isinstance(k, bool):
                raise StateCodecError(f"{path} has a key of type {type(k).__name__}; expected str or int keys")
            items.append([k, _encode(v, f"{path}[{k!r}]", tensors, seen)])
        return {"__items__": items}
    if isinstance(obj, (list, tuple)):
        values = [_encode(v, f"{path}[{i}]", tensors, seen) for i, v in enumerate(obj)]
        return {"__tuple__": values} if isinstance(obj, tuple) else values
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, (np.integer, np.floating, np.bool_)):
        return obj.item()
    raise StateCodecError(
        f"{path} is a {type(obj).__module__}.{type(obj).__name__}; a checkpoint stores only tensors, arrays, "
        "bytes and JSON scalars (nothing that needs pickle to load)"
    )


def _decode(node, tensors: dict[str, torch.Tensor], path: str):
    if isinstance(node, list):
        return [_decode(v, tensors, f"{path}[{i}]") for i, v in enumerate(node)]
    if not isinstance(node, dict):
        return node
    if len(node) == 1:
        ((tag, value),) = node.items()
        if tag in ("__tensor__", "__ndarray__", "__bytes__", "__bytesio__"):
            if value not in tensors:
                raise StateCodecError(f"{path} refers to tensor {value!r}, which the file does not hold")
            t = tensors[value]
            if tag == "__tensor__":
                return t
            if tag == "__ndarray__":
                return t.numpy()
            return io.BytesIO(t.numpy().tobytes()) if tag == "__bytesio__" else t.numpy().tobytes()
        if tag == "__tuple__":
            return tuple(_decode(v, tensors, f"{path}[{i}]") for i, v in enumerate(value))
        if tag == "__items__":
            return {k: _decode(v, tensors, f"{path}[{k!r}]") for k, v in value}
    return {k: _decode(v, tensors, f"{path}.{k}") for k, v in node.items()}


def state_bytes(state: dict, metadata: dict[str, str] | None = None) -> bytes:
    """The safetensors bytes ``save_state`` would write (plus ``metadata``), for a caller that writes them
    itself (the checkpoint hashes them on their way to the file). StateCodecError as in ``save_state``."""
    tensors: dict[str, torch.Tensor] = {}
    skeleton = _encode(state, "state", tensors, set())
    return save(tensors, metadata=(metadata or {}) | {SKELETON_KEY: json.dumps(skeleton)})


def save_state(state: dict, path: str | Path) -> None:
    """Write ``state`` to one ``.safetensors`` file (tensors + JSON skeleton in its metadata).

    Raises StateCodecError (naming the entry) before writing if ``state`` holds an unsupported object;
    OSError from the write itself propagates (the caller names what was being written).
    """
    tensors: dict[str, torch.Tensor] = {}
    skeleton = _encode(state, "state", tensors, set())
    try:
        save_file(tensors, str(path), metadata={SKELETON_KEY: json.dumps(skeleton)})
    except SafetensorError as exc:  # the Rust writer reports I/O failures as "... (os error N)"
        code = re.search(r"os error (\d+)", str(exc))
        if code is None:
            raise
        raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), str(path)) from None


def load_state(path: str | Path, device: str = "cpu") -> dict:
    """Read what ``save_state`` wrote; StateCodecError for a file that is not such a state."""
    path = Path(path)
    try:
        with safe_open(str(path), framework="pt", device=device) as fh:
            raw = (fh.metadata() or {}).get(SKELETON_KEY)
            if raw is None:
                raise StateCodecError(f"{path} has no {SKELETON_KEY!r} metadata; not a moe_rl checkpoint shard")
            tensors = {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118 -- safe_open is not iterable
        skeleton = json.loads(raw)
    except (SafetensorError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise StateCodecError(f"{path} is not a readable safetensors state: {exc}") from None
    except OSError as exc:
        raise StateCodecError(f"{path} cannot be read: {exc.strerror or exc}") from None
    return _decode(skeleton, tensors, "state")
