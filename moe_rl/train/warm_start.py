"""Supervised warm start: teacher forcing on the task's correct answers before RL, cached on disk.

Owns the short SFT phase (``train.warm_start``) and its cache. RL post-training starts from a
model that can already do the task a little; this phase gives the demo and the ablations such a
model in seconds. It trains a fresh Megatron-Core ``Learner`` (same model config, its own seed,
optimizer and LR) on ``prompt + answer + <eos>`` with the loss on the answer tokens only, saves
each rank's weights as safetensors under ``<cache_dir>/<key>/``, and loads them into the RL
learner. ``key`` hashes every input that changes the result (model, precision, parallel layout,
task, warm-start settings) and the code version (package version + the source of the modules
that produce the weights), so a changed config or code trains again and an unchanged one reuses
the file. ``train.seed`` is not part of it: every RL seed and ablation cell starts from the same
warm start.

Multi-node: ``cache_dir`` may be node-local (``~/.cache``). Whether the cache is used is decided once,
by rank 0, from every rank's view (its own shard and ``meta.json`` in its own directory) and broadcast:
the cache is used only when every rank has its files and they read back whole (a damaged file is named
in one line and rebuilt), otherwise every rank trains (a split decision
would leave some ranks in the training collectives and the others waiting elsewhere: a hang). Rank 0's
``meta.json`` is broadcast and written next to every rank's shard, so each node's cache is complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

import moe_rl
from moe_rl.learner.model import build_model
from moe_rl.learner.train_step import Learner

__all__ = [
    "apply_warm_start",
    "cache_path",
    "sft_microbatch",
    "teacher_forcing_batch",
    "temper",
    "train_warm_start",
    "warm_start_key",
]

# Modules whose source decides the warm-start weights (besides this one): the task and the model build.
_CODE_FILES = ("train/warm_start.py", "tasks/synthetic.py", "tasks/tokenizer.py", "learner/model.py")


def _code_version() -> str:
    root = Path(moe_rl.__file__).parent
    digest = hashlib.sha256(moe_rl.__version__.encode())
    for rel in _CODE_FILES:
        digest.update((root / rel).read_bytes())
    return f"{moe_rl.__version__}+{digest.hexdigest()[:12]}"


def warm_start_key(cfg) -> str:
    """Hex key of everything the warm-start weights depend on (config sections + code version)."""
    ws = cfg.train.warm_start
    inputs = {
        "model": cfg.model.model_dump(mode="json", exclude={"build_command"}),
        "params_dtype": cfg.precision.params_dtype,
        "parallel": cfg.parallel.model_dump(mode="json", exclude={"backend"}),
        "task": cfg.train.task,
        "warm_start": ws.model_dump(mode="json", exclude={"cache_dir"}),
        "code": _code_version(),
    }
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:20]


def _rank_world() -> tuple[int, int]:
    if torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _barrier() -> None:
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.barrier()


def _read_shard(directory: Path, rank: int) -> tuple[dict | None, str | None]:
    """This rank's view of the cache (its own shard and ``meta.json`` in its own directory): ``(weights, None)``
    when both read back whole, ``(None, None)`` when either is absent, ``(None, why)`` when one is damaged."""

    path, meta_path = directory / f"rank_{rank:05d}.safetensors", directory / "meta.json"
    if not (meta_path.is_file() and path.is_file()):
        return None, None
    current = path
    try:
        weights = load_file(str(path))
        current = meta_path
        history = json.loads(meta_path.read_text())["history"]
        float(history[0]["nll"]) + float(history[-1]["nll"])  # the fields the start-up line reads
    except Exception as exc:  # noqa: BLE001 -- SafetensorError, OSError, JSON, missing fields: all "damaged"
        return None, f"{current} ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
    return weights, None


def decide_cache_hit(directory: Path, rank: int, world: int) -> tuple[bool, list[int], list[str], dict | None]:
    """``(hit, ranks without usable files, damaged files, this rank's weights)`` on every rank: rank 0 gathers
    each rank's view, decides and broadcasts (a damaged file counts as absent and is rebuilt)."""
    weights, damaged = _read_shard(directory, rank)
    mine = (weights is not None, damaged)
    if world == 1:
        views = [mine]
    else:
        views = [None] * world if rank == 0 else None
        torch.distributed.gather_object(mine, views, dst=0)  # size: a flag and at most one damaged-file line per rank
    box = [None]
    if rank == 0:
        missing = [r for r, (has, _) in enumerate(views) if not has]
        box = [(not missing, missing, [why for _, why in views if why])]
    if world > 1:
        torch.distributed.broadcast_object_list(box, src=0)  # size: a flag, rank numbers, damaged-file lines
    hit, missing, bad = box[0]
    return hit, missing, bad, weights if hit else None


def _broadcast_meta(meta: dict | None) -> dict:
    """Rank 0's ``meta.json`` content on every rank."""
    if not (torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1):
        return meta
    box = [meta]
    # size: meta.json: a key, the config section and one short row per warm-start step (a few KB)
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def _write_meta(meta_path: Path, meta: dict) -> None:
    meta_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = meta_path.with_name(f".meta.json.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(meta, indent=1))
    os.replace(tmp, meta_path)


def cache_path(cfg) -> Path:
    """``<cache_dir>/<key>``: one ``rank_<r>.safetensors`` per rank plus ``meta.json``."""
    return Path(cfg.train.warm_start.cache_dir).expanduser() / warm_start_key(cfg)


def sft_microbatch(prompts, device: torch.device) -> dict[str, torch.Tensor]:
    """Teacher-forcing batch of ``prompt.ids + prompt.answer + [eos]`` for each prompt.

    Returns ``input_ids[B, T]`` (right-padded with ``<pad>``), ``targets[B, T]`` (next token, -1 on
    padding) and ``mask[B, T]`` (1.0 where the target is an answer token or the closing ``<eos>``),
    ``T = max(len(sequence)) - 1``.
    """
    from moe_rl.tasks.tokenizer import EOS_ID, PAD_ID  # noqa: PLC0415  the task tokenizer imports transformers

    return teacher_forcing_batch([(list(p.ids), list(p.answer) + [EOS_ID]) for p in prompts], PAD_ID, device)


def teacher_forcing_batch(seqs, pad_id: int, device: torch.device) -> dict[str, torch.Tensor]:
    """``sft_microbatch`` for any tokenizer: ``seqs`` are ``(prompt_ids, answer_ids)`` pairs (the answer
    ending with its EOS), right-padded with ``pad_id``; the loss mask covers the answer tokens."""
    T = max(len(a) + len(b) for a, b in seqs) - 1
    input_ids = torch.full((len(seqs), T), pad_id, dtype=torch.long, device="cpu")  # host build: train_step moves it
    targets = torch.full((len(seqs), T), -1, dtype=torch.long, device="cpu")
    mask = torch.zeros((len(seqs), T), dtype=torch.float32, device="cpu")
    for row, (prompt, response) in enumerate(seqs):
        tokens = torch.tensor(prompt + response, device="cpu")
        n = len(tokens) - 1
        input_ids[row, :n] = tokens[:-1]
        targets[row, :n] = tokens[1:]
        mask[row, len(prompt) - 1 : n] = 1.0  # targets from the first answer token on
    return {"input_ids": input_ids.to(device), "targets": targets.to(device), "mask": mask.to(device)}


def _nll_loss(logp: torch.Tensor, entropy, mb: dict) -> tuple[torch.Tensor, dict]:
    """Mean negative log-likelihood of the answer tokens; ``logp[B, T]``."""
    mask = mb["mask"]
    nll = -(logp * mask).sum() / mask.sum().clamp(min=1)
    with torch.no_grad():
        p_target = (logp.exp() * mask).sum() / mask.sum().clamp(min=1)
    return nll, {"nll": nll.detach(), "p_target": p_target}


def train_warm_start(cfg, log=None) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """Run the supervised phase on a fresh learner; returns its weights and per-step ``{nll, p_target}``.

    ``init_distributed`` must have run. Collective when world > 1 (every rank sees the same data;
    DDP averages identical gradients).
    """
    from moe_rl.tasks.synthetic import DigitTask  # noqa: PLC0415  the task tokenizer imports transformers

    ws = cfg.train.warm_start
    optim = cfg.optim.model_copy(update={"lr": ws.lr, "lr_warmup_steps": 0, "lr_decay_style": "constant"})
    sft_cfg = cfg.model_copy(update={"optim": optim})
    learner = Learner(sft_cfg, total_steps=ws.steps, model=build_model(sft_cfg, seed=ws.seed))
    device = next(learner.module.parameters()).device
    task = DigitTask(cfg.train.task, cfg.model.vocab_size)
    history = []
    for step in range(ws.steps):
        prompts = task.sample_prompts(ws.batch_size, np.random.default_rng([ws.seed, step]))
        stats = learner.train_step([sft_microbatch(prompts, device)], _nll_loss)
        history.append({"step": step + 1, "nll": stats.metrics["nll"], "p_target": stats.metrics["p_target"]})
        if log and ((step + 1) % 10 == 0 or step + 1 == ws.steps):
            log(
                f"[warm start] step {step + 1}/{ws.steps}: nll {stats.metrics['nll']:.3f}, "
                f"mean p(answer token) {stats.metrics['p_target']:.3f}"
            )
    weights = {k: v.detach().cpu().contiguous() for k, v in learner.module.state_dict().items() if torch.is_tensor(v)}
    return temper(weights, ws.temperature), history


def temper(weights: dict[str, torch.Tensor], temperature: float) -> dict[str, torch.Tensor]:
    """Divide the output layer (each rank's vocab shard alike) by ``temperature``: the same policy at T.

    Every logit is divided by T, so the most likely token is unchanged and T > 1 flattens each
    next-token distribution: ``softmax(z / T)``.
    """
    if temperature == 1.0:
        return weights
    (name,) = [k for k in weights if k.endswith("output_layer.weight")]
    return {**weights, name: (weights[name].float() / temperature).to(weights[name].dtype)}


def _save_atomic(weights: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    save_file(weights, str(tmp), metadata=metadata)
    os.replace(tmp, path)


def _load_into(module: torch.nn.Module, path: Path, weights: dict[str, torch.Tensor] | None = None) -> None:
    weights = load_file(str(path)) if weights is None else weights
    missing, unexpected = module.load_state_dict(weights, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise ValueError(
            f"warm-start cache {path} does not fit model.*: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}; delete it or change train.warm_start.cache_dir"
        )


def apply_warm_start(learner, cfg) -> dict | None:
    """Load the cached warm start into ``learner`` (training and caching it first if absent).

    No-op (returns None) when ``cfg.train.warm_start`` is None. Collective: every rank calls it.
    Returns ``{"path", "cached", "seconds", "nll_first", "nll_last"}``.
    """
    ws = cfg.train.warm_start
    if ws is None:
        return None
    rank, world = _rank_world()
    t0 = time.perf_counter()
    directory = cache_path(cfg)
    path = directory / f"rank_{rank:05d}.safetensors"
    meta_path = directory / "meta.json"
    # every rank has looked before any rank writes
    cached, missing, damaged, weights = decide_cache_hit(directory, rank, world)
    log = (lambda msg: print(msg, file=sys.stderr, flush=True)) if rank == 0 else None
    if log and damaged:
        log(
            f"[warm start] the cache file {'; '.join(damaged)} is damaged: rebuilding the warm start (train."
            "warm_start.cache_dir)"
        )
    if not cached:
        if log and world > 1 and len(missing) < world:
            log(
                f"[warm start] ranks {missing} have no cached shard under {directory} (train.warm_start.cache_dir "
                "is not shared between nodes?): every rank trains the warm start again"
            )
        weights, history = train_warm_start(cfg, log)
        _save_atomic(weights, path, {"key": directory.name, "rank": str(rank)})
        _barrier()
        meta = None
        if rank == 0:
            meta = {
                "key": directory.name,
                "world_size": world,
                "seconds": time.perf_counter() - t0,
                "warm_start": ws.model_dump(mode="json"),
                "task": cfg.train.task,
                "history": history,
            }
            _write_meta(meta_path, meta)
        meta = _broadcast_meta(meta)
        if rank != 0 and not meta_path.is_file():  # a node-local cache_dir: each node keeps a complete copy
            _write_meta(meta_path, meta)
        _barrier()
    else:
        meta = _broadcast_meta(json.loads(meta_path.read_text()) if rank == 0 else None)
    _load_into(learner.module, path, weights)
    info = {
        "path": str(directory),
        "cached": cached,
        "seconds": time.perf_counter() - t0,
        "nll_first": meta["history"][0]["nll"],
        "nll_last": meta["history"][-1]["nll"],
    }
    if log:
        how = "loaded from cache" if cached else f"trained {ws.steps} steps in {info['seconds']:.1f} s"
        tempered = f"; RL starts from it at temperature {ws.temperature:g}" if ws.temperature != 1.0 else ""
        log(f"[warm start] {how}: nll {info['nll_first']:.3f} -> {info['nll_last']:.3f}{tempered} ({directory})")
    return info
