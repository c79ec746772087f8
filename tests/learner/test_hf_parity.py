"""HF Qwen3-MoE vs Megatron-Core after conversion: same logits (fp32) and same top-k routes."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from moe_rl.learner.hf_convert import canonical_name, read_hf_state_dict
from moe_rl.learner.hf_import import load_hf_weights
from moe_rl.learner.hf_init import write_random_hf_checkpoint
from moe_rl.learner.model import build_model, forward_logits, moe_routers
from moe_rl.learner.train_step import Learner
from tests.learner.conftest import make_cfg

VARIANTS = {
    "normalised_topk": {},
    "pre_softmax_16x4_dense_first": {
        "num_layers": 3,
        "num_moe_experts": 16,
        "moe_router_topk": 4,
        "moe_router_pre_softmax": True,
        "first_k_dense_layers": 1,
    },
}


def _hf_model(hf_dir, device):
    return AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).to(device).eval()


def _hf_topk_sets(hf_model, ids):
    """Per MoE layer, top-k expert sets for tokens in [B*T] (batch-major) order."""
    sets, hooks = [], []
    for layer in hf_model.model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None:
            hooks.append(gate.register_forward_hook(lambda _m, _i, out: sets.append(out[2].sort(-1).values)))
    with torch.no_grad():
        logits = hf_model(ids).logits
    for h in hooks:
        h.remove()
    return logits, sets


def _megatron_topk_sets(model, ids):
    """Per MoE layer, top-k expert sets re-ordered from Megatron's [T*B] (sequence-major) rows."""

    B, T = ids.shape
    sets, hooks = [], []
    for router in moe_routers(model):

        def hook(_m, _i, out):
            routing_map = out[1]  # bool [T*B, E]
            k = int(routing_map.sum(-1)[0])
            idx = routing_map.nonzero()[:, 1].view(T, B, k).transpose(0, 1).reshape(B * T, k)
            sets.append(idx.sort(-1).values)

        hooks.append(router.register_forward_hook(hook))
    with torch.no_grad():
        logits = forward_logits(model, ids)
    for h in hooks:
        h.remove()
    return logits, sets


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_hf_and_megatron_agree_after_conversion(variant, megatron_world, tmp_path, device):

    # A larger init std than the default makes the logits sensitive to every mapping detail.
    cfg = make_cfg(init_method_std=0.1, **VARIANTS[variant])
    hf_dir = write_random_hf_checkpoint(cfg.model, tmp_path / "hf", seed=3)
    check_parity(cfg, hf_dir, build_model(cfg, seed=99).eval(), device, variant)


def check_parity(cfg, hf_dir, model, device, label: str) -> None:
    """Import ``hf_dir`` into ``model``; fp32 logits within 1e-4 of HF and top-k expert sets 100 % equal."""

    hf = _hf_model(hf_dir, device)
    load_hf_weights(model, hf_dir, cfg.model)
    ids = torch.randint(0, cfg.model.vocab_size, (3, 40), generator=torch.Generator().manual_seed(0)).to(device)
    hf_logits, hf_sets = _hf_topk_sets(hf, ids)
    mg_logits, mg_sets = _megatron_topk_sets(model, ids)

    diff = (hf_logits - mg_logits).abs().max().item()
    print(f"[{label}] HF vs Megatron logits max abs diff = {diff:.3e} (logit scale {hf_logits.abs().max():.2f})")
    assert diff < 1e-4, f"logits differ by {diff:.3e} after conversion (target < 1e-4)"
    assert len(hf_sets) == len(mg_sets) == cfg.model.num_moe_layers
    for layer, (a, b) in enumerate(zip(hf_sets, mg_sets)):
        agree = (a == b).all(-1).float().mean().item()
        assert agree == 1.0, f"MoE layer {layer}: only {agree:.1%} of tokens share the HF top-k expert set"


def test_export_round_trips_hf_tensors_bitwise(megatron_world, tmp_path):
    """Learner initialised from an HF dir (checkpoint.init_from_hf) exports the same tensors back."""

    cfg = make_cfg(num_layers=2, first_k_dense_layers=1)
    src = write_random_hf_checkpoint(cfg.model, tmp_path / "src", seed=5)
    cfg.checkpoint.init_from_hf = str(src)
    out = Learner(cfg, total_steps=1).export_hf(tmp_path / "out")

    a, b = read_hf_state_dict(src), read_hf_state_dict(out)
    assert sorted(a) == sorted(b), f"tensor names differ: {sorted(set(a) ^ set(b))[:5]}"
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} changed in the HF -> Megatron -> HF round trip"
    assert (out / "config.json").exists() and (out / "tokenizer.json").exists()
    assert not list(tmp_path.glob(".out.tmp-*")), "temporary export dir left behind"


def test_import_rejects_checkpoint_of_another_shape(megatron_world, tmp_path):
    small = make_cfg(moe_ffn_hidden_size=16)
    src = write_random_hf_checkpoint(small.model, tmp_path / "src", seed=0)
    model = build_model(make_cfg(), seed=1)
    with pytest.raises(
        ValueError, match=r"linear_fc1.weight: HF tensor has shape \(32, 64\), model expects \(64, 64\)"
    ):
        load_hf_weights(model, src, make_cfg().model)


@pytest.mark.parametrize(
    "te_name,local_name",
    [
        ("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight", "decoder.layers.0.input_layernorm.weight"),
        ("decoder.layers.0.mlp.linear_fc1.layer_norm_weight", "decoder.layers.0.pre_mlp_layernorm.weight"),
        (
            "decoder.layers.3.mlp.experts.linear_fc1.weight12",
            "decoder.layers.3.mlp.experts.local_experts.12.linear_fc1.weight",
        ),
        (
            "decoder.layers.3.mlp.experts.linear_fc2.weight0",
            "decoder.layers.3.mlp.experts.local_experts.0.linear_fc2.weight",
        ),
        ("decoder.layers.3.mlp.router.weight", "decoder.layers.3.mlp.router.weight"),
        ("decoder.layers.3.pre_mlp_layernorm.weight", "decoder.layers.3.pre_mlp_layernorm.weight"),
    ],
)
def test_transformer_engine_spec_names_map_to_local_spec_names(te_name, local_name):
    """The TE spec (GPU) fuses norms into linears and groups experts; conversion sees local names."""

    assert canonical_name(te_name) == local_name
