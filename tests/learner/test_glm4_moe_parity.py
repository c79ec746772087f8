"""GLM-4.5 (``Glm4MoeForCausalLM``: sigmoid router + score-correction bias, group-limited top-k,
routed scaling, shared experts, first dense layer, q/k/v bias, partial RoPE) vs Megatron-Core after
conversion: fp32 logits < 1e-4, top-k expert sets 100 %, and HF -> Megatron -> HF bitwise."""

from __future__ import annotations

import pytest
import torch

from moe_rl.learner.hf_convert import read_hf_state_dict
from moe_rl.learner.hf_init import write_random_hf_checkpoint
from moe_rl.learner.model import build_model, forward_logits, moe_routers
from moe_rl.learner.train_step import Learner
from tests.learner.conftest import make_cfg
from tests.learner.test_hf_parity import check_parity

GLM = {
    "hf_architecture": "Glm4MoeForCausalLM",
    "num_layers": 3,
    "first_k_dense_layers": 1,
    "num_moe_experts": 16,
    "moe_router_topk": 4,
    "moe_router_score_function": "sigmoid",
    "moe_router_enable_expert_bias": True,
    "moe_router_num_groups": 4,
    "moe_router_group_topk": 2,
    "moe_router_topk_scaling_factor": 2.5,
    "moe_shared_expert_intermediate_size": 32,
    "add_qkv_bias": True,
    "rotary_percent": 0.5,
    "qk_layernorm": False,
    "moe_router_load_balancing_type": "none",
    "init_method_std": 0.1,
}


@pytest.mark.parametrize("qk_layernorm", [False, True])
def test_glm4_moe_hf_and_megatron_agree_after_conversion(qk_layernorm, megatron_world, tmp_path, device):
    cfg = make_cfg(**{**GLM, "qk_layernorm": qk_layernorm})
    hf_dir = write_random_hf_checkpoint(cfg.model, tmp_path / "hf", seed=3)
    model = build_model(cfg, seed=99).eval()
    check_parity(cfg, hf_dir, model, device, f"glm4_moe qk_norm={qk_layernorm}")
    biases = [b for n, b in model.named_buffers() if n.endswith("router.expert_bias")]
    assert len(biases) == 2 and all(b.abs().max() > 0 for b in biases), "score-correction bias not imported"


def test_glm4_moe_export_round_trips_hf_tensors_bitwise(megatron_world, tmp_path):
    cfg = make_cfg(**GLM)
    src = write_random_hf_checkpoint(cfg.model, tmp_path / "src", seed=5)
    cfg.checkpoint.init_from_hf = str(src)
    out = Learner(cfg, total_steps=1).export_hf(tmp_path / "out")
    a, b = read_hf_state_dict(src), read_hf_state_dict(out)
    assert sorted(a) == sorted(b), f"tensor names differ: {sorted(set(a) ^ set(b))[:5]}"
    assert any(n.endswith("e_score_correction_bias") for n in a) and any("shared_experts" in n for n in a)
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} changed in the HF -> Megatron -> HF round trip"


def test_expert_bias_load_counts_only_real_tokens_with_a_padding_mask(megatron_world, device):
    """Megatron-Core 0.16.1 broadcasts the flattened padding mask over the expert dim (fixed in
    moe_rl.learner.mcore_compat): the load behind the score-correction bias update must count
    k experts per non-padding token."""

    cfg = make_cfg(**GLM)
    model = build_model(cfg, seed=1).train()
    ids = torch.randint(0, cfg.model.vocab_size, (2, 5), generator=torch.Generator().manual_seed(0)).to(device)
    padding = torch.zeros(2, 5, dtype=torch.bool, device=device)
    padding[1, 3:] = True  # 2 pad tokens of 10
    forward_logits(model, ids, padding_mask=padding).float().pow(2).mean().backward()
    loads = [int(r.local_tokens_per_expert.sum()) for r in moe_routers(model)]
    assert loads == [8 * cfg.model.moe_router_topk] * 2, loads
