"""Random-init tiny MoE checkpoints in Hugging Face format, built locally from a config.

Owns the mapping from the experiment's ``model`` section to ``Qwen3MoeConfig`` or
``Glm4MoeConfig`` (``model.hf_architecture``, capabilities in ``hf_arch``) and
writing a complete checkpoint directory (weights, config, tokenizer) that SGLang
and ``transformers`` load with no hub access.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, Glm4MoeConfig, Qwen3MoeConfig

from moe_rl.config import ModelConfig
from moe_rl.learner.hf_arch import unsupported_for_hf
from moe_rl.tasks.tokenizer import BOS_ID, EOS_ID, PAD_ID, build_task_tokenizer


def _glm4_moe_config(m):
    """``Glm4MoeConfig`` (GLM-4.5) equivalent to ``m``."""

    return Glm4MoeConfig(
        vocab_size=m.vocab_size,
        hidden_size=m.hidden_size,
        intermediate_size=m.ffn_hidden_size,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_query_groups,
        head_dim=m.kv_channels,
        max_position_embeddings=m.seq_length,
        initializer_range=m.init_method_std,
        rms_norm_eps=m.layernorm_epsilon,
        rope_parameters={"rope_type": "default", "rope_theta": m.rotary_base},
        partial_rotary_factor=m.rotary_percent,
        attention_bias=m.add_qkv_bias,
        use_qk_norm=m.qk_layernorm,
        tie_word_embeddings=False,
        moe_intermediate_size=m.moe_ffn_hidden_size,
        n_routed_experts=m.num_moe_experts,
        n_shared_experts=m.moe_shared_expert_intermediate_size // m.moe_ffn_hidden_size,
        num_experts_per_tok=m.moe_router_topk,
        n_group=m.moe_router_num_groups or 1,
        topk_group=m.moe_router_group_topk or 1,
        routed_scaling_factor=m.moe_router_topk_scaling_factor or 1.0,
        first_k_dense_replace=m.first_k_dense_layers,
        norm_topk_prob=True,
        architectures=["Glm4MoeForCausalLM"],
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
    )


def hf_config_from_model_config(model_cfg):
    """HF config (``model.hf_architecture``) equivalent to ``model_cfg``."""

    unsupported = unsupported_for_hf(model_cfg)
    if unsupported:
        raise ValueError(f"the {model_cfg.hf_architecture} HF format cannot express: " + "; ".join(unsupported))
    if model_cfg.hf_architecture == "Glm4MoeForCausalLM":
        return _glm4_moe_config(model_cfg)
    pattern = model_cfg.moe_layer_pattern()
    return Qwen3MoeConfig(
        vocab_size=model_cfg.vocab_size,
        hidden_size=model_cfg.hidden_size,
        intermediate_size=model_cfg.ffn_hidden_size,
        num_hidden_layers=model_cfg.num_layers,
        num_attention_heads=model_cfg.num_attention_heads,
        num_key_value_heads=model_cfg.num_query_groups,
        head_dim=model_cfg.kv_channels,
        max_position_embeddings=model_cfg.seq_length,
        initializer_range=model_cfg.init_method_std,
        rms_norm_eps=model_cfg.layernorm_epsilon,
        rope_parameters={"rope_type": "default", "rope_theta": model_cfg.rotary_base},
        tie_word_embeddings=False,
        decoder_sparse_step=1,
        mlp_only_layers=[i for i, moe in enumerate(pattern) if not moe],
        moe_intermediate_size=model_cfg.moe_ffn_hidden_size,
        num_experts=model_cfg.num_moe_experts,
        num_experts_per_tok=model_cfg.moe_router_topk,
        # Megatron's default (softmax after top-k) renormalises the top-k probs; pre-softmax does not.
        norm_topk_prob=not model_cfg.moe_router_pre_softmax,
        router_aux_loss_coef=model_cfg.moe_aux_loss_coeff,
        architectures=["Qwen3MoeForCausalLM"],
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
    )


def write_hf_side_files(model_cfg, out_dir: str | Path) -> None:
    """Everything but the weights: ``config.json``, generation config and the task tokenizer."""

    out_dir = Path(out_dir)
    hf_cfg = hf_config_from_model_config(model_cfg)
    hf_cfg.save_pretrained(out_dir)
    GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID).save_pretrained(out_dir)
    build_task_tokenizer(model_cfg.vocab_size).save_pretrained(out_dir)


def write_random_hf_checkpoint(
    model_cfg, out_dir: str | Path, seed: int = 0, dtype: str = "float32", max_shard_size: str | None = None
) -> Path:
    """Write a random-init checkpoint (``model.hf_architecture``) + task tokenizer to ``out_dir`` and return it.

    ``max_shard_size`` (e.g. ``"20MB"``) writes several shards and ``model.safetensors.index.json``.

    Score-correction biases (GLM-4.5) are drawn too, so conversions that drop them are caught.
    """

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    hf_cfg = hf_config_from_model_config(model_cfg)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_cfg).to(getattr(torch, dtype))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.1 * torch.randn(buf.shape, generator=gen, device="cpu"))
    model.save_pretrained(out_dir, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    build_task_tokenizer(model_cfg.vocab_size).save_pretrained(out_dir)
    return out_dir


def write_example_init(out: str | Path, tokenizer, seed: int = 0) -> Path:
    """The shipped examples' random-init model (``scripts/make_*_example.py``): a 2-layer, 8-expert top-2 Qwen3-MoE
    of hidden size 64 whose vocabulary is padded past ``tokenizer`` (as Qwen pads its embeddings), written to
    ``<out>.init`` with ``tokenizer`` and its special-token ids in place of the task tokenizer; returns that path."""

    vocab = -(-len(tokenizer) // 64) * 64 + 64
    model_cfg = ModelConfig(
        num_layers=2,
        hidden_size=64,
        ffn_hidden_size=128,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=16,
        num_moe_experts=8,
        moe_router_topk=2,
        moe_ffn_hidden_size=64,
        vocab_size=vocab,
        seq_length=128,
    )
    out = Path(out)
    init = write_random_hf_checkpoint(model_cfg, out.with_name(out.name + ".init"), seed=seed)
    return use_tokenizer(init, tokenizer)


def use_tokenizer(hf_dir: str | Path, tokenizer) -> Path:
    """Put ``tokenizer`` in the checkpoint directory ``hf_dir`` in place of the task tokenizer
    ``write_random_hf_checkpoint`` wrote, with its eos / pad ids (and no bos) in ``config.json`` and
    ``generation_config.json``; returns ``hf_dir``."""

    hf_dir = Path(hf_dir)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (hf_dir / f).unlink(missing_ok=True)
    tokenizer.save_pretrained(hf_dir)
    ids = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id, "bos_token_id": None}
    for name in ("config.json", "generation_config.json"):
        cfg_json = json.loads((hf_dir / name).read_text())
        (hf_dir / name).write_text(json.dumps(cfg_json | ids, indent=2))
    return hf_dir
