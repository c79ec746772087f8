"""CI gate of ``rollout.true_on_policy`` on the DeepSeek-V3-style layout: a tiny ``Glm4MoeForCausalLM``.

Sigmoid router scores with a score-correction (expert) bias, group-limited top-k (4 groups, 2 chosen, top-4),
``moe_router_topk_scaling_factor`` 2.5, a shared expert, a first dense layer, q/k/v bias and partial RoPE
(half the head dim), trained at ep=2 with R3 and the distributed weight sync, 2 sync steps, on its own
true-on-policy SGLang server (another model than the tiny Qwen3 server's). As in
``test_true_on_policy_e2e``: ``offpolicy/log_ratio_abs_max``, ``offpolicy/kl_k3`` and both
``rollout_vs_natural`` flip rates are exactly 0.0 at every step.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from moe_rl.config import load_config
from moe_rl.learner.hf_init import write_random_hf_checkpoint
from moe_rl.rollout.launcher import SGLangServer
from moe_rl.rollout.server_spec import ServerSpec
from tests.exact.conftest import GATE, GLM4_LAYOUT
from tests.exact.test_true_on_policy_e2e import _assert_exact, _train

pytestmark = [pytest.mark.sglang, pytest.mark.distributed]

ROOT = Path(__file__).parents[2]
GLM4 = [*GLM4_LAYOUT, "model.init_method_std=0.1"]


@pytest.fixture(scope="module")
def glm4_server(tmp_path_factory) -> str:
    """A true-on-policy SGLang server for the tiny GLM-4.5 model (fp32); its URL."""
    cfg = load_config(ROOT / "configs" / "tiny_cpu.yaml", [*GATE, *GLM4])
    root = tmp_path_factory.mktemp("exact_glm4_server")
    model = write_random_hf_checkpoint(cfg.model, root / "model", seed=0, dtype="float32")
    spec = ServerSpec.from_rollout_config(cfg.rollout, model, startup_timeout_s=600)
    with SGLangServer(spec, root / "server.log") as running:
        yield running.url


@pytest.fixture(scope="module")
def glm4_run(tmp_path_factory, glm4_server):
    out = tmp_path_factory.mktemp("glm4_exact")
    overrides = ["replay.routing=r3", "parallel.ep=2", "rollout.weight_sync=distributed"]
    return out, _train(out, "tiny_cpu.yaml", *GLM4, *overrides, f"rollout.addresses=[{glm4_server}]", nproc=2)


def test_tiny_glm4_deepseek_v3_layout_ep2_r3_is_exact(glm4_run):
    """The four metrics are 0.0 at both steps: the second step's rollouts come from weights (and expert biases,
    updated by step 1) broadcast to the server."""
    _, metrics = glm4_run
    _assert_exact(metrics)
