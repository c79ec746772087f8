"""Shared fixtures: tiny model configs and a locally written tiny Qwen3-MoE HF checkpoint."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

from moe_rl.config import ModelConfig, load_config
from moe_rl.learner.hf_init import write_random_hf_checkpoint
from moe_rl.rollout.launcher import SGLangServer
from moe_rl.rollout.server_spec import ServerSpec
from tests.shm_watch import (  # noqa: F401 -- the session-end /dev/shm check's hooks
    pytest_runtest_protocol,
    pytest_sessionfinish,
    pytest_sessionstart,
    pytest_unconfigure,
)

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# One intra-op thread: the tiny models are dispatch-bound, and a second thread fights the SGLang
# server process (and the other torchrun rank) for the machine's 2 cores.
torch.set_num_threads(1)

__all__ = ["pytest_runtest_protocol", "pytest_sessionfinish", "pytest_sessionstart"]  # the /dev/shm check


def session_device() -> torch.device:
    """``cuda:0`` when a CUDA GPU is present, else ``cpu`` (the ``device`` fixture; also for helpers)."""
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def rank_device() -> torch.device:
    """This process's device in a multi-process test: its GPU (``init_distributed`` gives each rank
    ``cuda:<local_rank>``) or ``cpu``."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def repo_env(root, **extra: str) -> dict[str, str]:
    """The environment for a subprocess that imports this checkout: ``root`` first on PYTHONPATH, and
    whatever PYTHONPATH already held after it (``make gpu-check`` puts its offline wheels there)."""
    path = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def one_gpu_per_rank(ranks: int):
    """Skip mark for a ``ranks``-process test on a machine with CUDA but fewer GPUs than ranks
    (each rank takes its own GPU; on a CPU-only machine the ranks run over gloo)."""
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return pytest.mark.skipif(
        torch.cuda.is_available() and have < ranks,
        reason=f"needs {ranks} GPUs (one per rank, nccl); this machine has {have}",
    )


def run_to_file(cmd: list[str], console: Path, **kwargs) -> tuple[subprocess.CompletedProcess, str]:
    """Run ``cmd`` with its stdout and stderr written to ``console``; (the process, its output). A file, not a pipe:
    against a shared server the trainer's torch_shm_manager outlives the trainer while the server still maps the
    synced tensors, and would hold a pipe open."""
    with open(console, "w") as fh:
        proc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, check=False, **kwargs)
    return proc, console.read_text()


@pytest.fixture(scope="session")
def device() -> torch.device:
    """``cuda:0`` when a CUDA GPU is present, else ``cpu``: tests build their inputs on it."""
    return session_device()


@pytest.fixture(scope="session")
def tiny_model_cfg():
    """2-layer, 8-expert, top-2 Qwen3-MoE-shaped model config (the CPU test size)."""

    return ModelConfig(num_layers=2, hidden_size=64, num_moe_experts=8, moe_router_topk=2, vocab_size=512)


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory, tiny_model_cfg):
    """A random-init tiny Qwen3-MoE checkpoint (weights, config, tokenizer) written with save_pretrained."""

    return write_random_hf_checkpoint(tiny_model_cfg, tmp_path_factory.mktemp("tiny_hf"), seed=0)


@pytest.fixture(scope="session")
def tiny_cpu_server(tmp_path_factory) -> str:
    """One SGLang server with configs/tiny_cpu.yaml's model and rollout settings (bf16, deterministic) for the
    end-to-end runs that are not about the server: they pass ``rollout.addresses=[<url>]`` and push their own weights
    at their start (a full sync), as with a server of their own. Its URL."""

    cfg = load_config(Path(__file__).parents[1] / "configs" / "tiny_cpu.yaml")
    root = tmp_path_factory.mktemp("tiny_cpu_server")
    model = write_random_hf_checkpoint(cfg.model, root / "model", seed=0)
    spec = ServerSpec.from_rollout_config(cfg.rollout, model, startup_timeout_s=600)
    with SGLangServer(spec, root / "server.log") as running:
        yield running.url
