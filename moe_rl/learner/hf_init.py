"""Random-init tiny Qwen3-MoE checkpoints in Hugging Face format, built locally from a config.

Owns the mapping from the experiment's ``model`` section to ``Qwen3MoeConfig`` and
writing a complete checkpoint directory (weights, config, tokenizer) that SGLang
and ``transformers`` load with no hub access.
"""

from __future__ import annotations

from pathlib import Path

from moe_rl.rollout.tokenizer import BOS_ID, EOS_ID, PAD_ID, build_task_tokenizer


def hf_config_from_model_config(model_cfg):
    """``Qwen3MoeConfig`` equivalent to ``model_cfg`` (Qwen3-MoE family only)."""
    from transformers import Qwen3MoeConfig

    from moe_rl.learner.hf_arch import unsupported_for_hf

    unsupported = unsupported_for_hf(model_cfg)
    if unsupported:
        raise ValueError("the Qwen3-MoE HF format cannot express: " + "; ".join(unsupported))
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
    from transformers import GenerationConfig

    out_dir = Path(out_dir)
    hf_cfg = hf_config_from_model_config(model_cfg)
    hf_cfg.save_pretrained(out_dir)
    GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID).save_pretrained(out_dir)
    build_task_tokenizer(model_cfg.vocab_size).save_pretrained(out_dir)


def write_random_hf_checkpoint(model_cfg, out_dir: str | Path, seed: int = 0, dtype: str = "float32") -> Path:
    """Write a random-init Qwen3-MoE checkpoint + task tokenizer to ``out_dir`` and return it."""
    import torch
    from transformers import Qwen3MoeForCausalLM

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    hf_cfg = hf_config_from_model_config(model_cfg)
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(hf_cfg).to(getattr(torch, dtype))
    model.save_pretrained(out_dir)
    build_task_tokenizer(model_cfg.vocab_size).save_pretrained(out_dir)
    return out_dir
