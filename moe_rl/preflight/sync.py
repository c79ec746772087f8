"""Preflight rules of the weight sync (learner -> SGLang servers): what the HF bridge and the group update refuse.

Owns the config rules of the weight sync (an architecture the HF <-> Megatron bridge cannot express,
``rollout.weight_sync: distributed`` with options SGLang's group update cannot serve) and the environment
rule of its rendezvous (a free port on rank 0, a GPU for NCCL).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from moe_rl.config import ExperimentConfig
from moe_rl.learner.hf_arch import unsupported_for_hf
from moe_rl.sync.group import group_options, port_is_free

__all__ = ["weight_sync_architecture", "weight_sync_group", "weight_sync_rendezvous"]


def weight_sync_architecture(cfg: ExperimentConfig) -> Iterable[str]:
    """HF export (weight sync to SGLang, init_from_hf) covers the Qwen3-MoE family."""
    for reason in unsupported_for_hf(cfg.model):
        yield f"{reason}: the HF <-> Megatron bridge (weight sync to SGLang) cannot express it"


def weight_sync_group(cfg: ExperimentConfig) -> Iterable[str]:
    """``rollout.weight_sync: distributed``: NCCL moves CUDA tensors only (a CPU server cannot join), and
    SGLang's group update serves one data-parallel replica whose ranks are its tp ranks."""
    r = cfg.rollout
    if r.weight_sync != "distributed":
        return
    if r.weight_sync_backend == "nccl" and r.device != "cuda":
        yield (
            f"rollout.weight_sync_backend='nccl' with rollout.device={r.device!r}: a CPU SGLang server receives "
            "weights over gloo only; expected rollout.weight_sync_backend='gloo' (or 'auto')"
        )
    for option, value in _server_options(r.extra_server_args, _GROUP_UNSUPPORTED):
        yield (
            f"rollout.extra_server_args {option}{'' if value is None else ' ' + value} with "
            "rollout.weight_sync='distributed': SGLang 0.5.23's weight-update group asserts one data-parallel "
            "replica and ranks the server's processes by tp rank only (pipeline stages would collide); "
            "expected that option left out (or at 1), or rollout.weight_sync='disk'"
        )


# SGLang server options the distributed weight update cannot serve: name -> (takes a value, refused unless == "1")
_GROUP_UNSUPPORTED = {
    "--dp-size": True,
    "--data-parallel-size": True,
    "--attn-dp-size": True,
    "--attention-data-parallel-size": True,
    "--pp-size": True,
    "--pipeline-parallel-size": True,
    "--enable-dp-attention": False,
}


def _server_options(args: list[str], table: dict[str, bool]) -> Iterable[tuple[str, str | None]]:
    """``(option, value)`` of each option of ``table`` set in ``args`` to something other than 1."""
    for i, arg in enumerate(args):
        name, eq, inline = arg.partition("=")
        if name not in table:
            continue
        if not table[name]:
            yield name, None
            continue
        value = inline if eq else (args[i + 1] if i + 1 < len(args) else "")
        if value.strip() != "1":
            yield name, value


# --- environment rules --------------------------------------------------------------------------


def weight_sync_rendezvous(cfg: ExperimentConfig, environ: Mapping[str, str]) -> Iterable[str]:
    """``rollout.weight_sync: distributed``: rank 0 can listen on the rendezvous port; NCCL has a GPU here."""
    r = cfg.rollout
    if r.weight_sync != "distributed":
        return
    port = r.weight_sync_master_port
    if port is not None and environ.get("RANK", "0") == "0" and not port_is_free(port):
        yield (
            f"rollout.weight_sync_master_port={port} is in use on this host; rank 0 listens there for the "
            "weight-update group's rendezvous: expected a free port (or null: pick one)"
        )
    if group_options(r)["backend"] == "nccl" and not torch.cuda.is_available():
        yield (
            "rollout.weight_sync='distributed' over nccl broadcasts from the learner's GPU, and this machine has "
            "none; expected rollout.weight_sync_backend='gloo' with CPU servers, or another rollout.weight_sync"
        )
