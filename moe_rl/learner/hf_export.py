"""The learner's weights as an HF checkpoint directory, written in parallel by the ranks that own them.

Owns the sharded HF directory: every sending rank (``hf_stream``: tp/etp rank 0 of data-parallel replica 0,
each expert-parallel owner for its own experts, each pipeline stage for its layers) writes its buckets as
``model-r<rank>-<n>.safetensors`` into one temporary directory next to the target, rank 0 gathers the names
only and writes ``model.safetensors.index.json`` (``weight_map`` and ``metadata.total_size``, as
transformers writes it) and the side files (config, tokenizer: copied from the template directory or made
by ``hf_init``), then renames the directory into place (an existing one is replaced). SGLang and
transformers load the result as any sharded HF checkpoint. No rank holds more than a bucket or two.

``train.export_hf``, the export the servers start from and the disk weight sync all write this way.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

from moe_rl.learner.dist import RankComm
from moe_rl.learner.hf_convert import write_side_files
from moe_rl.learner.hf_stream import HFStream, size_buckets

__all__ = ["ShardWriter", "begin_dir", "export_hf_checkpoint", "finish_dir", "write_hf_checkpoint"]

INDEX = "model.safetensors.index.json"


class ShardWriter:
    """One rank's buckets -> ``<prefix>-<n>.safetensors`` files in ``directory``; ``weight_map`` for the index."""

    def __init__(self, directory: str | Path, prefix: str):
        self.directory, self.prefix = Path(directory), prefix
        self.weight_map: dict[str, str] = {}
        self.total_size = 0

    def write(self, bucket: Mapping[str, torch.Tensor]) -> None:
        name = f"{self.prefix}-{len(set(self.weight_map.values())):05d}.safetensors"
        # copies: a bucket's tensors may be views of live parameters, or share one storage (gate/up halves)
        tensors = {n: t.detach().to("cpu", copy=True).contiguous() for n, t in bucket.items()}
        save_file(tensors, self.directory / name, metadata={"format": "pt"})
        self.weight_map.update(dict.fromkeys(tensors, name))
        self.total_size += sum(t.numel() * t.element_size() for t in tensors.values())


def begin_dir(out_dir: str | Path) -> Path:
    """A fresh temporary directory next to ``out_dir`` (same filesystem: the final rename is atomic)."""
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))


def finish_dir(
    tmp: Path,
    out_dir: str | Path,
    writers: list[tuple[dict[str, str], int]],
    model_cfg,
    template_dir: str | Path | None = None,
) -> Path:
    """Index (``writers``: every rank's ``(weight_map, total_size)``), side files, then ``tmp`` -> ``out_dir``."""
    weight_map = {n: f for wm, _ in writers for n, f in sorted(wm.items())}
    index = {
        "metadata": {"total_size": sum(size for _, size in writers)},
        "weight_map": dict(sorted(weight_map.items())),
    }
    (tmp / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    write_side_files(tmp, model_cfg, Path(template_dir) if template_dir is not None else None)
    out = Path(out_dir)
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old)
    else:
        os.replace(tmp, out)
    return out


def write_hf_checkpoint(
    hf: Mapping[str, torch.Tensor],
    model_cfg,
    out_dir: str | Path,
    template_dir: str | Path | None = None,
    bucket_bytes: int = 256 << 20,
) -> Path:
    """Write an HF state dict (this process) + side files to ``out_dir`` atomically, in bucket-sized files."""
    tmp = begin_dir(out_dir)
    writer = ShardWriter(tmp, "model-r00000")
    for bucket in size_buckets(hf, bucket_bytes):
        writer.write(dict(bucket))
    return finish_dir(tmp, out_dir, [(writer.weight_map, writer.total_size)], model_cfg, template_dir)


def export_hf_checkpoint(
    model,
    model_cfg,
    out_dir: str | Path,
    template_dir: str | Path | None = None,
    dtype: torch.dtype | None = None,
    bucket_bytes: int = 256 << 20,
    transform: Callable[[dict], dict] | None = None,
) -> Path | None:
    """Write the model as an HF checkpoint dir (module docstring). Collective over every learner rank.

    ``dtype``: cast each tensor; ``transform``: applied to each bucket before it is written (the FP8 rollout
    weights). Returns the path on rank 0, None elsewhere.
    """
    comm = RankComm(collective=True)
    tmp = comm.bcast(str(begin_dir(out_dir)) if comm.rank0 else None)  # size: one path
    stream = HFStream(model, model_cfg, bucket_bytes, gather_experts=False)
    writer = ShardWriter(tmp, f"model-r{comm.rank:05d}")
    for bucket in stream.buckets():
        named = {n: t if dtype is None else t.to(dtype) for n, t in bucket}
        writer.write(transform(named) if transform is not None else named)
        del named, bucket
    # size: this rank's tensor names -> file name (~100 B per tensor it wrote) and an int, received by rank 0 at
    # its own size (no padding); rank 0 writes them all into the index anyway
    every = comm.gather((writer.weight_map, writer.total_size))
    path = finish_dir(Path(tmp), out_dir, every, model_cfg, template_dir) if comm.rank0 else None
    comm.barrier_if(True)  # the directory exists before any rank goes on
    return path
