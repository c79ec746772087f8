"""GLM-4.5 (``Glm4MoeForCausalLM``) on the real SGLang CPU engine: the served routes equal HF
``transformers``' teacher-forced routing (sigmoid + score-correction bias, group-limited top-k) in
fp32, and the records carry one route row per forwarded token for the MoE layers only."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from moe_rl.config import ModelConfig
from moe_rl.learner.hf_init import write_random_hf_checkpoint
from moe_rl.records import RouteSpec
from moe_rl.rollout.client import RolloutClient, SamplingSettings
from moe_rl.rollout.launcher import SGLangServer
from moe_rl.rollout.server_spec import ServerSpec

pytestmark = pytest.mark.sglang

GLM = ModelConfig(
    hf_architecture="Glm4MoeForCausalLM",
    num_layers=3,
    first_k_dense_layers=1,
    vocab_size=256,
    num_moe_experts=16,
    moe_router_topk=4,
    moe_router_score_function="sigmoid",
    moe_router_enable_expert_bias=True,
    moe_router_num_groups=4,
    moe_router_group_topk=2,
    moe_router_topk_scaling_factor=2.5,
    moe_shared_expert_intermediate_size=32,
    moe_ffn_hidden_size=32,
    add_qkv_bias=True,
    rotary_percent=0.5,
    qk_layernorm=False,
    init_method_std=0.1,
)


@pytest.fixture(scope="module")
def glm_dir(tmp_path_factory):
    return write_random_hf_checkpoint(GLM, tmp_path_factory.mktemp("glm4_moe"), seed=0)


@pytest.fixture(scope="module")
def batch(glm_dir, tmp_path_factory):
    spec = ServerSpec(
        model_path=str(glm_dir), dtype="float32", deterministic=True, mem_fraction_static=0.3, startup_timeout_s=600
    )
    rng = np.random.default_rng(0)
    prompts = [rng.integers(4, GLM.vocab_size, size=int(rng.integers(5, 16))).tolist() for _ in range(4)]
    with SGLangServer(spec, tmp_path_factory.mktemp("glm_logs") / "server.log") as server:
        client = RolloutClient(
            [server.url],
            RouteSpec.from_model_config(GLM),
            GLM.vocab_size,
            SamplingSettings(temperature=1.0, top_p=0.9, top_k=16, max_new_tokens=8),
        )
        return client.generate(prompts, n=2)


@torch.no_grad()
def hf_routes(model, tokens: np.ndarray, device) -> np.ndarray:
    """HF's own routing decision ``[T, L_moe, k]`` (sorted) for ``tokens[T]``, teacher-forced."""
    picked = []
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda _m, _i, out: picked.append(out[2].sort(-1).values))
        for layer in model.model.layers
        if hasattr(layer.mlp, "gate")
    ]
    try:
        model(torch.as_tensor(tokens, dtype=torch.long, device=device)[None])
    finally:
        for h in hooks:
            h.remove()
    return torch.stack(picked, dim=1).cpu().numpy()


def test_glm4_moe_served_routes_equal_hf_teacher_forced_routing(batch, glm_dir, device):
    hf = AutoModelForCausalLM.from_pretrained(glm_dir, dtype=torch.float32).eval().to(device)
    agree = total = 0
    for s in batch:
        tokens = np.concatenate([s.prompt_ids, s.response_ids])[:-1]
        assert s.routes.shape == (len(tokens), 2, 4), s.routes.shape  # MoE layers 1 and 2 only
        same = (np.sort(s.routes.astype(np.int64), axis=-1) == hf_routes(hf, tokens, device)).all(axis=-1)
        agree, total = agree + int(same.sum()), total + same.size
    print(f"GLM-4.5 SGLang vs HF teacher-forced routes: {agree}/{total}")
    assert total >= 80 and agree == total, f"routes equal HF for {agree}/{total} (token, layer) pairs"
