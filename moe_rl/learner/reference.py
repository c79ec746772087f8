"""Frozen reference policy π_ref for the KL penalty (``loss.kl_coef > 0``).

Owns the reference model: a second ``GPTModel`` with the learner's Megatron layout holding
the weights at the start of RL (after HF import or warm start), with no gradients, its
log-probs for a microbatch (natural routing, or the routes the old-log-prob pass used),
optional CPU offload between uses, and its layout-free safetensors files (``sharded_state``: every
rank writes its own chunks of the global tensors keyed by global names, so a run resumed on another
parallel layout reloads it; the previous release's single ``model.safetensors`` still loads). It never
touches the learner's model, optimizer or RNG streams.

Lifecycle (the KL anchor must never silently be another run's, another step's or half of one):
``<ckpt>/reference/`` holds the ranks' ``model-r<rank>.safetensors`` and a completion marker
``complete.json`` naming the run id, written by rank 0 only after every rank's file is in place. ``save_reference`` runs before
a run's first checkpoint (so no checkpoint exists without its reference) and replaces anything else
in the directory; on resume ``reference_problem`` must find this run's marker, or the resume is
refused — a missing reference is never rebuilt from the resumed (trained) weights.
``checkpoint.overwrite`` deletes the directory with the old run. Rank 0 decides, every rank follows
(``moe_rl.learner.dist.decided_by_rank0``).

Wiring (trainer): build it once with ``ReferencePolicy.from_learner(cfg, learner.module)``
right after the learner is initialised (or ``ReferencePolicy.load(cfg, ckpt_dir)`` on resume);
``save_reference`` before the first checkpoint; in the old-log-prob pass call
``logprobs(mb, temperature, logprob_fn, routes=...)`` per microbatch with the routes π_old
used, all inside one ``with reference.on_device():`` so an offloaded model moves to the device
and back once per pass, not once per microbatch; pass the result as ``ref_logp`` to the loss.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from moe_rl.learner.dist import decided_by_rank0
from moe_rl.learner.global_state import MODEL_FORMAT, GlobalFile, GlobalStateError, load_model
from moe_rl.learner.logprobs import response_logprobs
from moe_rl.learner.model import build_model
from moe_rl.learner.pipeline import pipeline_logprobs, pipeline_size
from moe_rl.learner.rng_streams import rng_state, set_rng_state
from moe_rl.learner.sharded_state import ShardedDir, save_model_shards
from moe_rl.learner.train_step import default_logprob_fn
from moe_rl.replay.binding import RoutingReplay

__all__ = ["REFERENCE_DIR", "ReferencePolicy", "reference_path", "reference_problem", "save_reference"]

REFERENCE_DIR = "reference"
MARKER_FILE = "complete.json"
MARKER_FORMAT = "moe_rl.reference-complete/1"
REFERENCE_FILE = "model-r00000.safetensors"  # rank 0's file; every rank writes its own model-r<rank>
LEGACY_REFERENCE_FILE = "model.safetensors"  # one global file (the previous release)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def reference_path(ckpt_dir: str | Path) -> Path:
    """``<ckpt_dir>/reference/``'s rank-0 weights file (``sharded_state``: every rank's ``model-r<rank>`` chunks
    of the global tensors; loads on any parallel layout), or the previous release's global ``model.safetensors``."""
    where = Path(ckpt_dir) / REFERENCE_DIR
    legacy = where / LEGACY_REFERENCE_FILE
    return legacy if legacy.is_file() and not (where / REFERENCE_FILE).is_file() else where / REFERENCE_FILE


def _reference_source(ckpt_dir: str | Path):
    path = reference_path(ckpt_dir)
    return GlobalFile(path, MODEL_FORMAT) if path.name == LEGACY_REFERENCE_FILE else ShardedDir(path.parent, "model")


def _read_marker(ckpt_dir: str | Path) -> dict | None:
    try:
        marker = json.loads((Path(ckpt_dir) / REFERENCE_DIR / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) and marker.get("format") == MARKER_FORMAT else None


def reference_problem(ckpt_dir: str | Path, run_id: str) -> str | None:
    """Why ``<ckpt_dir>/reference/`` is not this run's complete reference (None: it is). Call on rank 0."""
    where = Path(ckpt_dir) / REFERENCE_DIR
    marker = _read_marker(ckpt_dir)
    if marker is None:
        state = "is incomplete (no completion marker: a save was interrupted)" if where.is_dir() else "is missing"
        return f"the reference policy in {where} {state}"
    if marker.get("run_id") != run_id:
        return f"the reference policy in {where} belongs to run {marker.get('run_id')!r}, not this run ({run_id!r})"
    if not reference_path(ckpt_dir).is_file():
        return f"the reference policy in {where} lacks its weights file {REFERENCE_FILE}"
    return None


def save_reference(policy: ReferencePolicy, ckpt_dir: str | Path, run_id: str) -> bool:
    """Make ``<ckpt_dir>/reference/`` this run's complete reference (collective; True if it wrote).

    Rank 0 decides whether this run's marker is already there; if not, it clears the directory,
    the weights are gathered and written, and rank 0 writes the marker last.
    """

    if decided_by_rank0(lambda: reference_problem(ckpt_dir, run_id)) is None:
        return False
    where = Path(ckpt_dir) / REFERENCE_DIR
    if _rank() == 0:
        shutil.rmtree(where, ignore_errors=True)
    _barrier()
    policy.save(ckpt_dir)
    _barrier()
    if _rank() == 0:
        world = dist.get_world_size() if dist.is_initialized() else 1
        tmp = where / f".{MARKER_FILE}.tmp"
        tmp.write_text(json.dumps({"format": MARKER_FORMAT, "run_id": run_id, "world_size": world}))
        os.replace(tmp, where / MARKER_FILE)
    _barrier()
    return True


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _tensor_state(model) -> dict[str, torch.Tensor]:
    """The model's tensor state (parameters and buffers; Megatron's ``_extra_state`` blobs left out)."""
    return {k: v for k, v in model.state_dict().items() if torch.is_tensor(v) and not k.endswith("_extra_state")}


class ReferencePolicy:
    """π_ref: a frozen ``GPTModel`` (same layout as the learner) and its log-prob pass.

    ``offload=True`` keeps the weights on the CPU between passes: :meth:`on_device` moves them
    to the learner's device for a whole pass (one move there, one back), and :meth:`logprobs`
    called outside it moves them for that call alone. A no-op on a CPU-only machine.
    """

    def __init__(self, model, *, offload: bool = False, device: torch.device | None = None):
        self.model = model
        self.model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.offload = bool(offload)
        self.device = device if device is not None else next(model.parameters()).device
        self._replay = None
        self._resident = False  # inside on_device(): the weights are on self.device
        if self.offload:
            self.model.to("cpu")

    # ------------------------------------------------------------------ construction
    @staticmethod
    def _build(cfg):
        """A fresh model of ``cfg``'s layout, built without disturbing any RNG stream the learner uses."""

        state = rng_state()
        try:
            return build_model(cfg)
        finally:
            set_rng_state(state)

    @classmethod
    def from_learner(cls, cfg, learner_module, *, offload: bool = False) -> ReferencePolicy:
        """Copy ``learner_module``'s current weights (the bare ``GPTModel``, e.g. ``Learner.module``)."""
        model = cls._build(cfg)
        missing, unexpected = model.load_state_dict(_tensor_state(learner_module), strict=False)
        _check_keys(missing, unexpected, "learner state")
        return cls(model, offload=offload, device=next(learner_module.parameters()).device)

    @classmethod
    def load(cls, cfg, ckpt_dir: str | Path, *, offload: bool = False) -> ReferencePolicy:
        """Rebuild π_ref from ``save``'s file, sliced for this job's layout; a clear error if missing or mismatched."""

        path = reference_path(ckpt_dir)
        if not path.is_file():
            raise FileNotFoundError(
                f"{path}: no reference weights; loss.kl_coef > 0 needs the reference policy saved "
                "with the first checkpoint (start a new run, or set loss.kl_coef=0)"
            )
        model = cls._build(cfg)
        try:
            load_model(model, _reference_source(ckpt_dir))
        except GlobalStateError as exc:
            raise ValueError(f"reference policy: {exc}") from None
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        return cls(model, offload=offload, device=device)

    def save(self, ckpt_dir: str | Path) -> Path:
        """Write the weights to ``<ckpt_dir>/reference/`` (collective: every rank calls it and writes the
        chunks it owns, ``sharded_state``; other files in the directory are kept). Completeness is the
        marker's job (``save_reference`` writes it last)."""

        where = Path(ckpt_dir) / REFERENCE_DIR
        if _rank() == 0:
            where.mkdir(parents=True, exist_ok=True)
        _barrier()
        save_model_shards(self.model, where)
        _barrier()
        return reference_path(ckpt_dir)

    # ------------------------------------------------------------------ use
    @contextlib.contextmanager
    def on_device(self):
        """Keep an offloaded reference on the learner's device for a whole pass over microbatches.

        One ``model.to(device)`` on entry and one ``model.to("cpu")`` on exit; nested uses (each
        :meth:`logprobs` inside the pass) move nothing. A no-op without offload or on a CPU device.
        """
        if self._resident or not self.offload or self.device is None or self.device.type == "cpu":
            yield
            return
        self.model.to(self.device)
        self._resident = True
        try:
            yield
        finally:
            self._resident = False
            self.model.to("cpu")

    def _routing(self, routes: torch.Tensor | None, local: bool):
        if routes is None:
            return contextlib.nullcontext()
        if self._replay is None:
            self._replay = RoutingReplay(self.model)
        return self._replay.replay([routes], local=local, observe_natural=False)

    @torch.no_grad()
    def logprobs(
        self,
        mb: dict,
        temperature: float = 1.0,
        logprob_fn=None,
        *,
        routes: torch.Tensor | None = None,
        local_routes: bool = False,
    ) -> torch.Tensor:
        """``ref_logp[B, T]`` of ``mb["targets"]`` under π_ref for one microbatch.

        ``logprob_fn(model, mb, temperature) -> (logp, entropy)`` is the learner's (Keep Sampling
        Mask renormalisation included); None = full softmax. ``routes``: the routes π_old's pass
        used for this microbatch — the rollout's ``[B, S, L_moe, K]`` under R3, or the recorded
        local routes (``local_routes=True``) under R2 — so π_ref and π_old see the same experts;
        None = natural routing (``replay.routing: none``).
        """

        with self.on_device(), self._routing(routes, local_routes):
            if pipeline_size() > 1:  # this rank's stage of π_ref; the last stage's log-probs on every stage
                logp = pipeline_logprobs(self.model, [mb], logprob_fn or default_logprob_fn, temperature)[0]
            elif logprob_fn is not None:
                logp, _ = logprob_fn(self.model, mb, temperature)
            else:
                logp, _ = response_logprobs(
                    self.model,
                    mb["input_ids"],
                    mb["targets"],
                    segment_ids=mb.get("segment_ids"),
                    temperature=temperature,
                    with_entropy=False,
                )
        return logp.detach()

    def close(self) -> None:
        """Release the reference model's router binding (if replay was used)."""
        if self._replay is not None:
            self._replay.close()
            self._replay = None


def _check_keys(missing, unexpected, source: str) -> None:
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise ValueError(
            f"reference policy: {source} does not match the model layout (missing {missing[:5]}, "
            f"unexpected {list(unexpected)[:5]}); expected the same model config and parallel layout"
        )
