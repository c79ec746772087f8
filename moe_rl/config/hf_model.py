"""The ``model`` section read back from a Hugging Face ``config.json`` (``model.hf_path``).

Owns the inverse of ``moe_rl.learner.hf_init``: for the Qwen3-MoE and GLM-4.5 families, every
architecture key the ``model`` section holds (layers, widths, heads, experts, top-k, router type,
bias, groups, shared experts, dense-first layers, RoPE base/fraction, eps, vocab size, max
positions) from the HF names. Training knobs that ``config.json`` happens to carry
(``router_aux_loss_coef``) are not architecture and are not read. Pure Python: no torch, no
transformers (the schema fills a section from it; the preflight reports disagreements).
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = [
    "HF_ARCHITECTURES",
    "HFModelError",
    "initial_weights_dir",
    "model_keys_from_hf",
    "read_hf_config",
    "same_value",
    "side_files_dir",
]

HF_ARCHITECTURES = {"qwen3_moe": "Qwen3MoeForCausalLM", "glm4_moe": "Glm4MoeForCausalLM"}
# keys where None and the HF neutral value mean the same thing (GLM-4.5 writes n_group=1, scaling 1.0)
_NEUTRAL = {"moe_router_num_groups": 1, "moe_router_group_topk": 1, "moe_router_topk_scaling_factor": 1.0}


class HFModelError(ValueError):
    """``model.hf_path`` does not hold a config.json moe_rl can read; the message says why."""


def read_hf_config(hf_path: str | Path) -> dict:
    """``DIR/config.json`` as a dict; HFModelError naming ``model.hf_path`` otherwise."""
    path = Path(hf_path).expanduser()
    if not path.is_dir():
        raise HFModelError(
            f"model.hf_path={str(hf_path)!r} does not exist or is not a directory; expected a Hugging "
            "Face model directory (config.json, weights, tokenizer)"
        )
    file = path / "config.json"
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise HFModelError(
            f"model.hf_path={str(hf_path)!r} has no config.json; expected a Hugging Face model directory"
        ) from None
    except (OSError, ValueError) as exc:
        raise HFModelError(f"model.hf_path={str(hf_path)!r}: {file} is not readable JSON ({exc})") from None
    if not isinstance(data, dict):
        raise HFModelError(f"model.hf_path={str(hf_path)!r}: {file} is not a JSON object")
    return data


def _architecture(hf: dict, where: str) -> str:
    archs = hf.get("architectures") or []
    for arch in archs:
        if arch in HF_ARCHITECTURES.values():
            return arch
    if hf.get("model_type") in HF_ARCHITECTURES:
        return HF_ARCHITECTURES[hf["model_type"]]
    raise HFModelError(
        f"model.hf_path={where!r}: config.json has architectures={archs} model_type="
        f"{hf.get('model_type')!r}; expected one of {sorted(HF_ARCHITECTURES.values())}"
    )


def _rope(hf: dict) -> tuple[float, float]:
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    fraction = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    return float(theta), float(fraction)


def _common(hf: dict) -> dict:
    theta, fraction = _rope(hf)
    heads = hf["num_attention_heads"]
    return {
        "vocab_size": hf["vocab_size"],
        "hidden_size": hf["hidden_size"],
        "ffn_hidden_size": hf["intermediate_size"],
        "num_layers": hf["num_hidden_layers"],
        "num_attention_heads": heads,
        "num_query_groups": hf.get("num_key_value_heads") or heads,
        "kv_channels": hf.get("head_dim") or hf["hidden_size"] // heads,
        "seq_length": hf["max_position_embeddings"],
        "init_method_std": hf.get("initializer_range", 0.02),
        "layernorm_epsilon": hf["rms_norm_eps"],
        "rotary_base": theta,
        "rotary_percent": fraction,
        "moe_ffn_hidden_size": hf["moe_intermediate_size"],
        "moe_router_topk": hf["num_experts_per_tok"],
    }


def _qwen3_moe(hf: dict) -> dict:
    layers, step = hf["num_hidden_layers"], hf.get("decoder_sparse_step", 1) or 1
    dense = set(hf.get("mlp_only_layers") or [])
    pattern = [0 if i in dense or (i + 1) % step else 1 for i in range(layers)]
    return _common(hf) | {
        "num_moe_experts": hf.get("num_experts", hf.get("num_local_experts")),
        "qk_layernorm": True,
        "add_qkv_bias": bool(hf.get("attention_bias", False)),
        "moe_router_score_function": "softmax",
        "moe_router_enable_expert_bias": False,
        "moe_router_pre_softmax": not hf.get("norm_topk_prob", True),
        "moe_router_num_groups": None,
        "moe_router_group_topk": None,
        "moe_router_topk_scaling_factor": None,
        "moe_shared_expert_intermediate_size": None,
        "first_k_dense_layers": 0,
        "moe_layer_freq": 1 if all(pattern) else pattern,
        "hf_architecture": "Qwen3MoeForCausalLM",
    }


def _glm4_moe(hf: dict) -> dict:
    shared = hf.get("n_shared_experts") or 0
    groups, group_topk = hf.get("n_group") or 1, hf.get("topk_group") or 1
    scaling = hf.get("routed_scaling_factor", 1.0)
    return _common(hf) | {
        "num_moe_experts": hf["n_routed_experts"],
        "qk_layernorm": bool(hf.get("use_qk_norm", False)),
        "add_qkv_bias": bool(hf.get("attention_bias", False)),
        "moe_router_score_function": "sigmoid",
        "moe_router_enable_expert_bias": True,
        "moe_router_pre_softmax": False,
        "moe_router_num_groups": None if groups == 1 else groups,
        "moe_router_group_topk": None if groups == 1 else group_topk,
        "moe_router_topk_scaling_factor": None if scaling == 1.0 else float(scaling),
        "moe_shared_expert_intermediate_size": shared * hf["moe_intermediate_size"] or None,
        "first_k_dense_layers": hf.get("first_k_dense_replace", 0),
        "moe_layer_freq": 1,
        "hf_architecture": "Glm4MoeForCausalLM",
    }


def model_keys_from_hf(hf: dict, where: str = "") -> dict:
    """``{model key: value}`` equivalent to an HF ``config.json`` (Qwen3-MoE or GLM-4.5)."""
    arch = _architecture(hf, where)
    try:
        return _qwen3_moe(hf) if arch == "Qwen3MoeForCausalLM" else _glm4_moe(hf)
    except KeyError as exc:
        raise HFModelError(f"model.hf_path={where!r}: config.json lacks {exc.args[0]!r}, which {arch} needs") from None


def same_value(key: str, a, b) -> bool:
    """Whether two values of model ``key`` mean the same (None == the HF neutral value; 1 == [1, 1, ...])."""
    if key in _NEUTRAL:
        a, b = (_NEUTRAL[key] if v is None else v for v in (a, b))
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return float(a) == float(b)
    return a == b


def initial_weights_dir(cfg) -> str | None:
    """Where the initial weights come from: ``checkpoint.init_from_hf``, else ``model.hf_path`` (else random init)."""
    return cfg.checkpoint.init_from_hf or cfg.model.hf_path


def side_files_dir(cfg) -> str | None:
    """Where exported HF dirs take config, tokenizer and chat template from: ``model.hf_path``, else
    ``checkpoint.init_from_hf`` (else ``hf_init`` writes them for the built-in task tokenizer)."""
    return cfg.model.hf_path or cfg.checkpoint.init_from_hf
