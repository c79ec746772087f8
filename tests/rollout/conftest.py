"""Session fixtures for the rollout tests: one tiny Qwen3-MoE checkpoint and one real SGLang CPU server.

The model has a dense first layer (first_k_dense_layers=1) so route decoding must drop it, and 4 layers so
that it splits into 2 pipeline stages. The server
runs in fp32 with deterministic inference; tests that need another server (bf16, killed mid-batch)
start their own in tests/rollout/test_bf16_server.py.
"""

from __future__ import annotations

import pytest

from moe_rl.config import ModelConfig
from moe_rl.learner.hf_init import write_random_hf_checkpoint
from moe_rl.records import RouteSpec
from moe_rl.rollout.launcher import SGLangServer
from moe_rl.rollout.server_spec import ServerSpec


@pytest.fixture(scope="session")
def rollout_model_cfg() -> ModelConfig:
    """4 layers, the first dense: route decoding must drop its all-zero rows; a MoE layer on each of 2 pipeline
    stages (the 2-rank sync test loads it at pp=2)."""
    return ModelConfig(num_layers=4, first_k_dense_layers=1, vocab_size=512)


@pytest.fixture(scope="session")
def route_spec(rollout_model_cfg) -> RouteSpec:
    return RouteSpec.from_model_config(rollout_model_cfg)


def _write(model_cfg, out_dir, seed):
    return write_random_hf_checkpoint(model_cfg, out_dir, seed=seed, dtype="float32")


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory, rollout_model_cfg):
    return _write(rollout_model_cfg, tmp_path_factory.mktemp("rollout_model_v1"), seed=0)


@pytest.fixture(scope="session")
def model_dir_v2(tmp_path_factory, rollout_model_cfg):
    """Same architecture, different random weights (a stand-in for a learner export)."""
    return _write(rollout_model_cfg, tmp_path_factory.mktemp("rollout_model_v2"), seed=1)


@pytest.fixture(scope="session")
def server_spec(model_dir) -> ServerSpec:
    # On CPU SGLang sizes its budget from free host RAM before/after loading; on a shared machine other
    # processes' allocations in between read as "weights used it all" at 0.05. max_total_tokens caps the
    # KV cache anyway, so a larger fraction only widens that tolerance.
    return ServerSpec(
        model_path=str(model_dir),
        dtype="float32",
        deterministic=True,
        max_total_tokens=4096,
        mem_fraction_static=0.3,
        startup_timeout_s=240,
    )


@pytest.fixture(scope="session")
def sglang_server(server_spec, tmp_path_factory):
    """The session's SGLang CPU server (fp32, deterministic, routed experts on); stopped at the end."""
    with SGLangServer(server_spec, tmp_path_factory.mktemp("sglang_logs") / "server.log") as server:
        yield server
