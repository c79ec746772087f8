"""The architecture fingerprint records carry: what shaped their routes and behaviour log-probs.

A fingerprint is a flat dict ``{"model.<field>": value, ..., "tokenizer.vocab": "<sha256> (<n> tokens)"}``
of the model-section fields that change a forward pass's routing or log-probs (``ARCHITECTURE_FIELDS``)
plus, when one is used, a digest of the tokenizer's vocabulary. The fields themselves are stored (not
only a hash) so a refusal can name every field that differs. ``TRAINING_ONLY_FIELDS`` lists the model
fields that do not (initialisation, auxiliary losses, the learner's dispatch and router precision, the
position limit that ``RolloutBatch.validate`` checks on its own): every ``ModelConfig`` field is in
exactly one of the two lists (a test holds new fields to that).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping

__all__ = [
    "ARCHITECTURE_FIELDS",
    "TOKENIZER_KEY",
    "TRAINING_ONLY_FIELDS",
    "architecture_fingerprint",
    "fingerprint_diff",
    "fingerprint_id",
    "vocab_digest",
]

ARCHITECTURE_FIELDS = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "qk_layernorm",
    "vocab_size",
    "rotary_base",
    "rotary_percent",
    "add_qkv_bias",
    "layernorm_epsilon",
    "num_moe_experts",
    "moe_router_topk",
    "moe_ffn_hidden_size",
    "moe_router_score_function",
    "moe_router_pre_softmax",
    "moe_router_enable_expert_bias",
    "moe_router_num_groups",
    "moe_router_group_topk",
    "moe_router_topk_scaling_factor",
    "moe_layer_freq",
    "first_k_dense_layers",
    "moe_shared_expert_intermediate_size",
    "hf_architecture",
)
TRAINING_ONLY_FIELDS = (
    "seq_length",  # a length limit, checked per sample by RolloutBatch.validate(model)
    "init_method_std",
    "moe_aux_loss_coeff",
    "moe_z_loss_coeff",
    "moe_router_load_balancing_type",
    "moe_token_dispatcher_type",
    "moe_expert_capacity_factor",
    "moe_router_fusion",
    "moe_router_dtype",
    "mtp_num_layers",  # extra prediction heads: the main head's log-probs and routes do not depend on them
    "hf_path",  # where the model was read from: its architecture is in the fields above, its tokenizer in tokenizer.vocab
    "build_command",  # how hf_path is created on a fresh clone
)
TOKENIZER_KEY = "tokenizer.vocab"


def vocab_digest(tokenizer) -> str:
    """``"<sha256 of the sorted token -> id pairs, 16 hex> (<n> tokens)"`` of a vocabulary dict or a
    tokenizer with ``get_vocab()`` (Hugging Face tokenizers, slow or fast)."""
    vocab = tokenizer if isinstance(tokenizer, Mapping) else tokenizer.get_vocab()
    canon = json.dumps(sorted((str(k), int(v)) for k, v in vocab.items()), separators=(",", ":"))
    return f"{hashlib.sha256(canon.encode()).hexdigest()[:16]} ({len(vocab)} tokens)"


def architecture_fingerprint(model_cfg, tokenizer=None) -> dict:
    """The fingerprint of ``model_cfg`` (a ``ModelConfig``), with ``tokenizer``'s vocabulary when given
    (a dict token -> id, or an object with ``get_vocab()``)."""
    out = {}
    for name in ARCHITECTURE_FIELDS:
        value = getattr(model_cfg, name)
        out[f"model.{name}"] = list(value) if isinstance(value, (list, tuple)) else value
    if tokenizer is not None:
        out[TOKENIZER_KEY] = vocab_digest(tokenizer)
    return out


def fingerprint_id(fingerprint: Mapping) -> str:
    """A short digest of a whole fingerprint (12 hex), for display."""
    return hashlib.sha256(json.dumps(dict(fingerprint), sort_keys=True).encode()).hexdigest()[:12]


def fingerprint_diff(records: Mapping, learner: Mapping) -> list[str]:
    """One ``"key: <records' value> in the records, <learner's value> here"`` per differing key; a key
    that only one side carries differs too (shown as ``absent``)."""

    def show(side: Mapping, key: str) -> str:
        return json.dumps(side[key]) if key in side else "absent"

    return [
        f"{key}: {show(records, key)} in the records, {show(learner, key)} here"
        for key in sorted(set(records) | set(learner))
        if key not in records or key not in learner or records[key] != learner[key]
    ]
