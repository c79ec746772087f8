"""Fixtures of the true-on-policy tests: the learner tests' single-rank Megatron world, and the session's one
true-on-policy tiny_cpu server (the e2e gate and ``moe-rl certify`` share it through ``rollout.addresses``)."""

from pathlib import Path

import pytest

from moe_rl.config import load_config
from moe_rl.learner.hf_init import write_random_hf_checkpoint
from moe_rl.rollout.launcher import SGLangServer
from moe_rl.rollout.server_spec import ServerSpec
from tests.learner.conftest import megatron_world  # noqa: F401  (re-exported fixture)

ROOT = Path(__file__).parents[2]
GATE = [
    "rollout.true_on_policy=true",
    "rollout.dtype=float32",
    "train.minibatches_per_step=1",
    "replay.keep_sampling_mask=false",
    "train.steps=2",
    "train.prompts_per_step=2",
    "rollout.samples_per_prompt=4",
    "train.micro_batch_size=4",
    "rollout.max_new_tokens=8",
    "checkpoint.save_interval=100",
    "logging.tensorboard=false",
    "logging.progress=false",
    "rollout.startup_timeout_s=600",
    "rollout.health_timeout_s=300",  # the exact kernels are slow: a loaded CI box must not read that as a hang
]

# The tiny DeepSeek-V3-style layout (GLM-4.5: sigmoid scores + expert bias, grouped top-k, scaling, a shared
# expert, qkv bias, partial RoPE) as overrides of configs/tiny_cpu.yaml.
GLM4_LAYOUT = [
    "model.hf_architecture=Glm4MoeForCausalLM",
    "model.num_layers=3",
    "model.first_k_dense_layers=1",
    "model.num_moe_experts=16",
    "model.moe_router_topk=4",
    "model.moe_router_score_function=sigmoid",
    "model.moe_router_enable_expert_bias=true",
    "model.moe_router_num_groups=4",
    "model.moe_router_group_topk=2",
    "model.moe_router_topk_scaling_factor=2.5",
    "model.moe_shared_expert_intermediate_size=64",
    "model.add_qkv_bias=true",
    "model.rotary_percent=0.5",
    "model.qk_layernorm=false",
]


@pytest.fixture(scope="session")
def tiny_server(tmp_path_factory) -> str:
    """A true-on-policy SGLang server for configs/tiny_cpu.yaml under GATE (patch 0013's kernels); its URL."""

    cfg = load_config(ROOT / "configs" / "tiny_cpu.yaml", GATE)
    root = tmp_path_factory.mktemp("exact_server")
    model = write_random_hf_checkpoint(cfg.model, root / "model", seed=0, dtype="float32")
    spec = ServerSpec.from_rollout_config(cfg.rollout, model, startup_timeout_s=600)
    assert spec.true_on_policy and spec.dtype == "float32"
    with SGLangServer(spec, root / "server.log") as running:
        yield running.url
