"""Learner checkpoints: save / resume model + optimizer + RNG + step, atomically, without pickle,
on any parallel layout.

Owns the on-disk layout ``<dir>/step_<N>/`` (``model-r<r>.safetensors``, ``optimizer-r<r>.safetensors``,
``rank_<r>.safetensors``, ``meta.json``) and the ``<dir>/latest`` pointer. ``N`` is the caller's step
(the trainer passes the RL step, which is what ``checkpoint.save_interval`` counts); the optimizer
step is stored inside. Weights and Adam state are stored layout-free, as chunks of global tensors
keyed by global parameter names (``global_state``, ``ownership``): each rank writes only the chunks
it owns (``sharded_state``: its experts, its tp slices, its share of the replicated tensors, under
the distributed optimizer its own shard), in parallel, with no gather; rank 0 adds only ``meta.json``.
A checkpoint written under one (tp, etp, ep, pp, dp) layout, with the distributed optimizer on or off,
resumes under any other; each rank's ``rank_<r>`` file holds only its RNG streams and the step
(captured and restored by ``rng_streams``).
Same layout: every stream is restored and on CPU the next step is reproduced bit for bit.
Changed layout: the process-wide streams (python, numpy, torch) continue from rank 0's and the
Megatron tracker keeps this layout's seeding (its streams are per tp/ep rank), with a warning.
A checkpoint becomes visible only when complete: files go to a temp dir that rank 0 renames, then
``latest`` is replaced. Loading never unpickles (safetensors + JSON only); a step dir holding a
pickle-based file (``*.pt``, a ``torch_dist`` ``.metadata``, ...) is refused without reading it.
Format 5 binds every file to its save (``checksums``): headers carry the run id and step, ``meta.json``
(written last) each file's sha256 digests, taken as it is written; a load verifies them, each rank its own
files. Formats 2-4 (no checksums) load with one warning; 3 (one global ``model.safetensors`` /
``optimizer.safetensors``) on any layout, 2 (per-rank state dicts) on the layout that wrote them.
A corrupt, damaged or missing newest checkpoint falls back to the newest readable one, with one warning
(rank 0's, naming the file and what differed, whichever rank found it).
Write failures (disk full, permissions) name the path.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from moe_rl.learner.checksums import (
    DamagedCheckpoint,
    binding,
    checksum_table,
    hashed_copy,
    hashed_write,
    verify_save,
)
from moe_rl.learner.dist import RankComm
from moe_rl.learner.global_state import (
    MODEL_FORMAT,
    OPTIMIZER_FORMAT,
    GlobalFile,
    GlobalStateError,
    load_model,
    load_optimizer,
)
from moe_rl.learner.rng_streams import portable_rng, rng_state, set_rng_state
from moe_rl.learner.sharded_state import ShardedDir, rank_file, save_model_shards, save_optimizer_shards
from moe_rl.learner.state_codec import StateCodecError, load_state, state_bytes

__all__ = [
    "CheckpointError",
    "checkpoint_steps",
    "completed_rl_step",
    "latest_step",
    "layout",
    "load_checkpoint",
    "refuse_pickles",
    "save_checkpoint",
]

logger = logging.getLogger(__name__)
# 1 = torch.save pickles (refused); 2 = per-rank state dicts (same layout only); 3 = one global file per kind
# written by rank 0 (still loads on any layout); 4 = each rank writes what it owns; 5 = 4 + run id / step in
# every file's header and per-file / per-chunk sha256 in meta.json (``checksums``)
FORMAT_VERSION = 5
UNCHECKED_VERSIONS, UNCHECKED = (2, 3, 4), "an earlier release: no checksums, its files were loaded unverified"
MODEL_FILE, OPTIMIZER_FILE = "model.safetensors", "optimizer.safetensors"  # format 3
# What torch.save / torch_dist / pickle write: never opened, the step dir is refused.
PICKLE_PATTERNS = ("*.pt", "*.pth", "*.pkl", "*.pickle", "*.bin", "*.distcp", ".metadata")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written (path and cause named) or none of the existing ones can be loaded safely."""


def _rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _first_problem(reason: str) -> str:
    """``""`` when no rank has a problem, else the lowest such rank's ``reason``, on every rank."""
    if _all_ranks_agree(not reason) or not dist.is_initialized() or dist.get_world_size() == 1:
        return reason
    reasons: list = [None] * dist.get_world_size()
    dist.all_gather_object(reasons, reason)  # size: one reason line per rank (a few hundred bytes)
    return next(r for r in reasons if r)


def _all_ranks_agree(ok: bool) -> bool:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return ok
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"  # NCCL reduces device tensors only
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _write_error(exc: OSError, what: str, path: Path) -> CheckpointError:
    reason = errno.errorcode.get(exc.errno or 0, "error")
    hint = {
        errno.ENOSPC: "the disk is full",
        errno.EACCES: "permission denied",
        errno.EROFS: "read-only file system",
        errno.EDQUOT: "disk quota exceeded",
    }.get(exc.errno, exc.strerror or str(exc))
    return CheckpointError(f"cannot write {what} to {path}: {hint} ({reason}); check checkpoint.dir")


def _atomic_write_text(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)


CARRIED_FILES = "files"  # a step dir's copies of save_checkpoint(files=...)


def _step_dir(ckpt_dir: Path, step: int) -> Path:
    return ckpt_dir / f"step_{step:08d}"


def checkpoint_steps(ckpt_dir: str | Path) -> list[int]:
    """Steps of the visible (renamed, hence complete at save time) checkpoint dirs, ascending."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    return sorted(int(d.name[5:]) for d in ckpt_dir.glob("step_*") if d.name[5:].isdigit() and d.is_dir())


def latest_step(ckpt_dir: str | Path) -> int | None:
    """Step named by ``<dir>/latest`` (None if absent or unreadable; see ``load_checkpoint`` for fallback)."""
    pointer = Path(ckpt_dir) / "latest"
    try:
        return int(pointer.read_text().strip())
    except (OSError, ValueError):
        return None


def completed_rl_step(ckpt_dir: str | Path) -> int | None:
    """RL step recorded by the newest checkpoint's ``meta.json`` (None when there is no readable one)."""
    for step in _candidates(Path(ckpt_dir)):
        try:
            meta = json.loads((_step_dir(Path(ckpt_dir), step) / "meta.json").read_text())
            return int(meta.get("extra", {}).get("rl_step", meta["step"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return None


def layout() -> dict[str, int]:
    """This job's parallel sizes (as Megatron resolved them: etp None -> tp, dp from the world size)."""

    return {
        "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "ep": ps.get_expert_model_parallel_world_size(),
        "cp": ps.get_context_parallel_world_size(),
        "etp": ps.get_expert_tensor_parallel_world_size(),
        "dp": ps.get_data_parallel_world_size(),
    }


def save_checkpoint(
    learner,
    ckpt_dir: str | Path,
    keep_last: int = 2,
    extra: dict | None = None,
    step: int | None = None,
    files: dict[str, Path] | None = None,
    run_id: str | None = None,
) -> Path:
    """Save ``learner`` (collective: every rank calls it) as ``step_<step>``; returns the step directory.

    ``step`` names the directory (default: the learner's optimizer step); ``extra`` (JSON-serialisable,
    e.g. the trainer's data cursor) goes in ``meta.json``; ``files`` (rank 0's ``{name: source}``, e.g. the
    async producer's finished-but-untrained records) are copied into ``<step dir>/files/`` inside the same
    atomic rename, so they exist exactly when the checkpoint does. ``run_id`` (the trainer's) and ``step`` go in
    every file's header and ``meta.json``, with every file's checksums (``checksums``). Older checkpoints beyond ``keep_last`` are
    deleted after the new one is visible. Raises CheckpointError naming the path on ENOSPC / EACCES.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1; got {keep_last}")
    ckpt_dir = Path(ckpt_dir)
    rank, world = _rank_world()
    step = learner.step if step is None else int(step)
    final = _step_dir(ckpt_dir, step)
    tmp = ckpt_dir / f".step_{step:08d}.tmp"
    try:
        if rank == 0:
            ckpt_dir.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a crashed save
            tmp.mkdir()
    except OSError as exc:
        raise _write_error(exc, "the checkpoint directory", tmp) from None
    _barrier()
    shard = {"format_version": FORMAT_VERSION, "step": step, "optimizer_step": learner.step, "rng": rng_state()}
    shard_path = tmp / f"rank_{rank:05d}.safetensors"
    bound, records = binding(run_id, step), {}
    for what, path, write in (  # every rank writes only what it owns: no gather, nothing through rank 0
        (
            f"rank {rank}'s model weights",
            rank_file(tmp, "model", rank),
            lambda p: save_model_shards(learner.module, p.parent, bound),
        ),
        (
            f"rank {rank}'s optimizer state",
            rank_file(tmp, "optimizer", rank),
            lambda p: save_optimizer_shards(learner.optimizer, learner.module, p.parent, bound),
        ),
        (f"rank {rank}'s RNG / step file", shard_path, lambda p: hashed_write(p, [state_bytes(shard, bound)])),
    ):
        try:
            records[path.name] = write(path)
        except OSError as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            raise _write_error(exc, what, path) from None
    gathered = RankComm(collective=True).gather(records)  # size: 65 B per 64 MiB chunk a rank wrote (~1 KB/GB)
    if rank == 0:
        meta = {
            "format_version": FORMAT_VERSION,
            "run_id": run_id,
            "step": step,
            "optimizer_step": learner.step,
            "world_size": world,
            "parallel": layout(),
            "distributed_optimizer": _distributed_optimizer(learner),
            "extra": extra or {},
        }
        try:
            for name, source in (files or {}).items():
                (tmp / CARRIED_FILES).mkdir(exist_ok=True)
                records[f"{CARRIED_FILES}/{name}"] = hashed_copy(source, tmp / CARRIED_FILES / name)
            meta["checksums"] = checksum_table({k: v for part in gathered for k, v in part.items()} | records)
            (tmp / "meta.json").write_text(json.dumps(meta, indent=1))  # last: the save's table of contents
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            _atomic_write_text(ckpt_dir / "latest", f"{step}\n")
        except OSError as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            raise _write_error(exc, "checkpoint metadata (meta.json / latest)", ckpt_dir) from None
        for old in checkpoint_steps(ckpt_dir)[:-keep_last]:
            shutil.rmtree(_step_dir(ckpt_dir, old), ignore_errors=True)
    _barrier()
    return final


def _candidates(ckpt_dir: Path) -> list[int]:
    """Steps to try, newest first: the ``latest`` pointer's, then every other visible dir."""
    steps = sorted(checkpoint_steps(ckpt_dir), reverse=True)
    pointer = latest_step(ckpt_dir)
    if pointer is not None and pointer in steps:
        steps.remove(pointer)
        steps.insert(0, pointer)
    return steps


def refuse_pickles(d: Path) -> None:
    """CheckpointError if ``d`` holds a file only pickle can read (checked by name: nothing is opened)."""
    found = sorted({f.name for pattern in PICKLE_PATTERNS for f in d.glob(pattern)})
    if found:
        raise CheckpointError(
            f"{d / found[0]} is a pickle checkpoint file; moe_rl refuses to unpickle (it can run arbitrary code). "
            "Only safetensors + JSON checkpoints are loaded; start from checkpoint.init_from_hf or convert the "
            "checkpoint in a trusted environment"
        )


def _read_step_dir(d: Path, rank: int, world: int) -> tuple[dict, dict]:
    """(meta, this rank's RNG/step state) of step dir ``d``; StateCodecError / GlobalStateError when unreadable."""
    refuse_pickles(d)
    try:
        meta = json.loads((d / "meta.json").read_text())
    except (OSError, ValueError) as exc:
        raise StateCodecError(f"{d / 'meta.json'} is missing or not JSON ({exc})") from None
    missing = (
        [k for k in ("format_version", "step", "world_size", "parallel") if k not in meta]
        if isinstance(meta, dict)
        else ["(not a JSON object)"]
    )
    if missing:
        raise StateCodecError(f"{d / 'meta.json'} lacks {missing}; not a moe_rl checkpoint")
    version = meta["format_version"]
    if version == 2:  # per-rank model/optimizer shards: the writing layout only
        if meta["world_size"] != world:
            raise ValueError(
                f"{d} is a format-2 checkpoint saved by {meta['world_size']} ranks "
                f"(parallel={meta['parallel']}); it loads only on that layout; this job has {world}"
            )
        return meta, load_state(d / f"rank_{rank:05d}.safetensors")
    if version not in (3, 4, FORMAT_VERSION):
        raise StateCodecError(f"{d} has format_version {version}; expected {FORMAT_VERSION} (or 2, 3, 4)")
    if version == FORMAT_VERSION:  # this rank's files: run id / step in their headers, their chunk digests
        verify_save(d, meta, rank, world)
    _sources(d, version)  # every header readable, every rank's file present
    return meta, load_state(d / f"rank_{rank if _same_layout(meta) else 0:05d}.safetensors")


def _sources(d: Path, version: int):
    """(model source, optimizer source) of a format-3 or format-4 step dir (headers read, no tensor)."""
    if version == 3:
        return GlobalFile(d / MODEL_FILE, MODEL_FORMAT), GlobalFile(d / OPTIMIZER_FILE, OPTIMIZER_FORMAT)
    return ShardedDir(d, "model"), ShardedDir(d, "optimizer")  # formats 4 and 5


def _distributed_optimizer(learner) -> bool:
    """Whether ``learner`` runs Megatron's distributed optimizer (recorded in ``meta.json``, for people)."""
    return bool(getattr(getattr(getattr(learner, "cfg", None), "optim", None), "use_distributed_optimizer", False))


def _same_layout(meta: dict) -> bool:
    return meta["world_size"] == _rank_world()[1] and meta["parallel"] == layout()


def load_checkpoint(learner, ckpt_dir: str | Path, step: int | None = None) -> dict | None:
    """Restore ``learner`` from ``step`` (default: newest readable); returns ``meta`` or None if none exists.

    The checkpoint may come from another parallel layout (tp, etp, ep, dp): weights and Adam state
    are resharded, ``meta["resharded_from"]`` names the saved layout (None when it is this one).
    With ``step=None`` an unreadable or damaged newest checkpoint (truncated file, missing meta, a file of
    another run or save, a checksum mismatch) is skipped with one warning (rank 0) naming it, what differed
    and the one used instead; CheckpointError when every candidate is unreadable.
    A pickle file in the step dir, or a model that does not fit the weights, raises at once.
    """
    ckpt_dir = Path(ckpt_dir)
    candidates = _candidates(ckpt_dir) if step is None else [step]
    if not candidates:
        return None
    rank, world = _rank_world()
    problems = []
    for s in candidates:
        d = _step_dir(ckpt_dir, s)
        try:
            meta, shard = _read_step_dir(d, rank, world)
            reason = ""
        except (StateCodecError, GlobalStateError, DamagedCheckpoint) as exc:
            meta, shard, reason = None, None, str(exc) or type(exc).__name__
        reason = _first_problem(reason)  # every rank skips it when one rank found its files damaged
        if reason:
            problems.append(f"{d.name}: {reason}")
            continue
        if problems and rank == 0:
            logger.warning(
                "resuming from %s instead of the newer unreadable or damaged checkpoint(s): %s", d, "; ".join(problems)
            )
        if meta["format_version"] in UNCHECKED_VERSIONS and rank == 0:
            logger.warning("%s is a format-%d checkpoint (%s)", d, meta["format_version"], UNCHECKED)
        return _apply(learner, d, meta, shard, problems)
    raise CheckpointError(f"no readable checkpoint under {ckpt_dir}: " + "; ".join(problems))


def _apply(learner, d: Path, meta: dict, shard: dict, problems: list[str]) -> dict:
    if meta["format_version"] == 2:
        learner.module.load_state_dict(shard["model"], strict=True)
        learner.optimizer.load_state_dict(shard["optimizer"])
        set_rng_state(shard["rng"])
        meta["resharded_from"] = None
    else:
        try:
            model_src, optim_src = _sources(d, meta["format_version"])
            load_model(learner.module, model_src)
            load_optimizer(learner.optimizer, learner.module, optim_src)
        except GlobalStateError as exc:  # readable, but written for another model: no fallback
            raise CheckpointError(f"{exc} (model.* must match the run that wrote {d})") from None
        same = _same_layout(meta)
        set_rng_state(shard["rng"] if same else portable_rng(shard["rng"]))
        meta["resharded_from"] = None if same else meta["parallel"]
        if not same and _rank_world()[0] == 0:
            logger.warning(
                "resharded checkpoint %s from %s (%d ranks) to %s (%d ranks); the RNG streams continue from rank 0's",
                d,
                meta["parallel"],
                meta["world_size"],
                layout(),
                _rank_world()[1],
            )
    learner.step = int(shard["optimizer_step"])
    meta["fallback_from"] = problems
    meta["files_dir"] = str(d / CARRIED_FILES)  # what save_checkpoint(files=...) carried
    return meta
