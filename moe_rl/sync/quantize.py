"""Mismatch injection: FP8 fake quantisation of the weights exported to the rollout engine.

Owns ``rollout.weight_quantization``: the linear projection weights of an exported HF
checkpoint are rounded through FP8 (e4m3 or e5m2) with per-tensor or 128x128 block
scales and written back in the original dtype, so the rollout policy is an FP8-weight
policy while the learner stays full precision (the FP8-rollout / BF16-train setting of
FlashRL and FP8-RL; seed 000, "sources of mismatch"). Embeddings, the LM head, norms and
router gates stay exact, as FP8 rollout recipes keep them.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
QUANTIZED_SUFFIXES = ("_proj.weight",)  # q/k/v/o and expert gate/up/down projections


def fake_quantize(weight: torch.Tensor, fmt: str, block: int | None = None) -> torch.Tensor:
    """``weight[out, in]`` rounded through ``fmt`` with per-tensor (``block=None``) or per-block absmax scales.

    Returns the dequantised tensor in ``weight``'s dtype; scale = absmax / max finite FP8 value,
    so the largest entry of each scale group maps onto the format's largest number.
    """
    if fmt not in FP8_DTYPES:
        raise ValueError(f"rollout.weight_quantization={fmt!r}; expected one of {sorted(FP8_DTYPES)} or 'none'")
    dtype = FP8_DTYPES[fmt]
    fmax = torch.finfo(dtype).max
    w = weight.float()
    if block is None or w.dim() != 2:
        scale = w.abs().amax().clamp_min(1e-12) / fmax
        return ((w / scale).to(dtype).float() * scale).to(weight.dtype)
    rows, cols = w.shape
    pr, pc = (-rows) % block, (-cols) % block
    padded = torch.nn.functional.pad(w, (0, pc, 0, pr))
    tiles = padded.view((rows + pr) // block, block, (cols + pc) // block, block)
    scale = tiles.abs().amax(dim=(1, 3), keepdim=True).clamp_min(1e-12) / fmax
    deq = (tiles / scale).to(dtype).float() * scale
    return deq.reshape(rows + pr, cols + pc)[:rows, :cols].contiguous().to(weight.dtype)


def quantize_hf_dir(hf_dir: str | Path, fmt: str, block: int | None = 128) -> int:
    """Fake-quantise the projection weights of every ``*.safetensors`` in ``hf_dir`` in place (atomic per file).

    Returns the number of tensors quantised.
    """
    count = 0
    for path in sorted(Path(hf_dir).glob("*.safetensors")):
        tensors = load_file(str(path))
        for name, tensor in tensors.items():
            if name.endswith(QUANTIZED_SUFFIXES):
                tensors[name] = fake_quantize(tensor, fmt, block)
                count += 1
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.close(fd)
        save_file(tensors, tmp, metadata={"format": "pt"})
        os.replace(tmp, path)
    return count
