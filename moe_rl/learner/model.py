"""Megatron-Core MoE GPT model for the learner: config mapping, build, forward.

Owns turning ``ExperimentConfig`` (model / parallel / precision / train sections)
into a Megatron ``TransformerConfig`` + layer spec + ``GPTModel``, and the plain
forward ``input_ids[B, T] -> logits[B, T, V/tp]``. The architecture follows
Qwen3-MoE (GQA, qk RMSNorm, RoPE rotate-half, SwiGLU experts, no linear bias) and
exposes the DeepSeek-V3 router options Megatron 0.16 has (sigmoid + expert bias,
grouped top-k). It must not hold optimizer or replay state.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.moe.router import TopKRouter

from moe_rl.exact.contract import kernels_of
from moe_rl.exact.kernels import silu
from moe_rl.learner.cpu_shims import apply_cpu_shims, seed_model_parallel_rng
from moe_rl.learner.device import model_device
from moe_rl.learner.fp8 import fp8_runtime_missing, fp8_transformer_fields, te_available
from moe_rl.learner.mcore_compat import apply_megatron_fixes

__all__ = [
    "attention_mask",
    "build_model",
    "forward_logits",
    "moe_routers",
    "transformer_config_from",
    "transformer_config_kwargs",
    "unwrap",
    "use_transformer_engine",
]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# the contract items a tp > 1 exact learner needs: sequence-parallel norms, tp-aware linears, LM head, log-softmax
_TP_ITEMS = frozenset({"rmsnorm", "linear", "lm_head", "log_softmax"})


def use_transformer_engine() -> bool:
    """TE layer spec when TE is importable and a GPU is present, else the local spec."""
    return te_available() and torch.cuda.is_available()


def transformer_config_from(cfg):
    """Megatron ``TransformerConfig`` for ``cfg`` (an ``ExperimentConfig``); see ``transformer_config_kwargs``."""

    return TransformerConfig(**transformer_config_kwargs(cfg))


def transformer_config_kwargs(cfg) -> dict:
    """Keyword arguments of Megatron's ``TransformerConfig`` for ``cfg``.

    Fixed choices (the Qwen3-MoE family): RMSNorm, SwiGLU, no linear/qkv bias,
    rotate-half RoPE, no dropout (RL log-probs must be deterministic), router in
    fp32 unless ``model.moe_router_dtype`` says fp64, SequentialMLP experts off-GPU.
    ``moe_enable_routing_replay`` is always on: it only attaches an idle
    ``RouterReplay`` to each router, and lets ``moe_rl.replay`` drive any model.
    Raises ``ValueError`` for FP8 on a machine without Transformer Engine + GPU.
    """
    m, p, prec = cfg.model, cfg.parallel, cfg.precision
    exact = _true_on_policy(cfg)
    if m.mtp_num_layers:
        raise ValueError(
            f"model.mtp_num_layers={m.mtp_num_layers}: multi-token prediction is not supported by the "
            "moe_rl learner yet; expected 0"
        )
    if p.tp > 1 and not use_transformer_engine() and not _TP_ITEMS <= exact:
        raise ValueError(
            f"parallel.tp={p.tp} needs Transformer Engine on a GPU: Megatron-Core trains MoE with tp > 1 only "
            "under sequence parallelism, which the local spec's torch norms do not support; use parallel.tp=1 here "
            "(or the true-on-policy kernels, whose norms are sequence-parallel capable)"
        )
    if p.tp > 1 and exact and (p.etp if p.etp is not None else p.tp) != 1:
        raise ValueError(
            f"parallel.tp={p.tp} under rollout.true_on_policy needs parallel.etp=1: the exact expert kernels run "
            "whole experts (no reduction split over expert-tensor-parallel ranks)"
        )
    fp8 = fp8_transformer_fields(prec.fp8)
    if fp8:
        missing = fp8_runtime_missing()
        if missing:
            raise ValueError(
                f"precision.fp8={prec.fp8.model_dump()} needs "
                + " and ".join(missing)
                + "; set precision.fp8=null on this machine"
            )
    params_dtype = _DTYPES[prec.params_dtype]
    on_gpu = torch.cuda.is_available()
    recompute = cfg.train.recompute == "full"
    return dict(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        ffn_hidden_size=m.ffn_hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups,
        kv_channels=m.kv_channels,
        qk_layernorm=m.qk_layernorm,
        layernorm_epsilon=m.layernorm_epsilon,
        init_method_std=m.init_method_std,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=_exact_silu() if "activation" in exact else F.silu,
        add_bias_linear=False,  # also avoids an in-place-on-view error on CPU
        add_qkv_bias=m.add_qkv_bias,
        bias_activation_fusion=False,
        apply_rope_fusion=False,
        rotary_interleaved=False,  # HF rotate-half
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # MoE
        num_moe_experts=m.num_moe_experts,
        moe_layer_freq=m.moe_layer_pattern(),
        moe_shared_expert_intermediate_size=m.moe_shared_expert_intermediate_size,
        moe_ffn_hidden_size=m.moe_ffn_hidden_size,
        moe_router_topk=m.moe_router_topk,
        moe_router_score_function=m.moe_router_score_function,
        moe_router_pre_softmax=m.moe_router_pre_softmax,
        moe_router_enable_expert_bias=m.moe_router_enable_expert_bias,
        moe_router_num_groups=m.moe_router_num_groups,
        moe_router_group_topk=m.moe_router_group_topk,
        moe_router_topk_scaling_factor=m.moe_router_topk_scaling_factor,
        moe_router_dtype=m.moe_router_dtype or "fp32",
        moe_aux_loss_coeff=m.moe_aux_loss_coeff,
        moe_z_loss_coeff=m.moe_z_loss_coeff,
        moe_router_load_balancing_type=m.moe_router_load_balancing_type,
        moe_token_dispatcher_type=m.moe_token_dispatcher_type,
        moe_expert_capacity_factor=m.moe_expert_capacity_factor,
        moe_router_fusion=m.moe_router_fusion,
        moe_grouped_gemm=on_gpu and use_transformer_engine(),
        moe_enable_routing_replay=True,
        # parallel
        tensor_model_parallel_size=p.tp,
        pipeline_model_parallel_size=p.pp,
        context_parallel_size=p.cp,
        expert_model_parallel_size=p.ep,
        expert_tensor_parallel_size=p.etp if p.etp is not None else p.tp,
        sequence_parallel=p.tp > 1,  # Megatron's MoE layer refuses to train with tp > 1 without it
        **_pipeline_fields(p.pp, params_dtype, on_gpu),
        # precision
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        use_cpu_initialization=not on_gpu,
        # precision.deterministic on CUDA: Megatron's deterministic paths (the embedding's gather, TE attention,
        # which also needs NVTE_ALLOW_NONDETERMINISTIC_ALGO=0: learner.dist.deterministic_kernels sets it)
        deterministic_mode=prec.deterministic and on_gpu,
        **fp8,
        # activation recompute
        recompute_granularity="full" if recompute else None,
        recompute_method="uniform" if recompute else None,
        recompute_num_layers=1 if recompute else None,
    )


def _true_on_policy(cfg) -> frozenset[str]:
    """The items of the true-on-policy kernel contract ``cfg`` turns on (none, all, or a subset)."""

    return kernels_of(cfg.rollout)


def _exact_silu():
    return silu


def _pipeline_fields(pp: int, params_dtype: torch.dtype, on_gpu: bool) -> dict:
    """Megatron's p2p settings for pp > 1 (none for pp = 1): the hidden states sent between stages
    have the params dtype; microbatches are ragged (each padded to its own length and size), so the
    shapes are exchanged first; on the host, no ``torch.cuda.synchronize`` after batched p2p."""
    if pp == 1:
        return {}
    return {"pipeline_dtype": params_dtype, "variable_seq_lengths": True, "batch_p2p_sync": on_gpu}


def _layer_spec(tcfg, use_te: bool, exact: frozenset[str] = frozenset()):
    spec = get_gpt_decoder_block_spec(tcfg, use_transformer_engine=use_te, normalization="RMSNorm")
    if exact:  # rollout.true_on_policy: the shared row-invariant kernels (moe_rl.exact)
        from moe_rl.learner.exact_spec import exact_layer_spec  # noqa: PLC0415  imports Megatron (lazy here)

        spec = exact_layer_spec(spec, exact)
    return spec


def build_model(cfg, seed: int | None = None):
    """Build the ``GPTModel`` for ``cfg``; ``init_distributed`` must have run.

    Under pipeline parallelism the model is this rank's stage: the embedding on the first stage,
    the output layer on the last, its share of the decoder layers on each. Weights are initialised
    from ``seed`` (default ``cfg.train.seed``) through Megatron's
    model-parallel RNG tracker. Experts draw from a per-ep-rank stream,
    so ep=1 and ep=2 builds differ in expert values: load the same weights (HF
    import or checkpoint) when runs must match.
    """

    apply_cpu_shims()  # first: on CPU the shim set lists te_general_gemm itself
    apply_megatron_fixes()
    tcfg = transformer_config_from(cfg)
    seed_model_parallel_rng(cfg.train.seed if seed is None else seed)
    use_te = use_transformer_engine()
    exact = _true_on_policy(cfg)
    if exact and use_te:
        raise ValueError(
            "rollout.true_on_policy runs the learner on the CPU kernels of moe_rl.exact; "
            "Transformer Engine on a GPU is not covered (see docs/true_on_policy.md)"
        )
    model = GPTModel(
        config=tcfg,
        transformer_layer_spec=_layer_spec(tcfg, use_te, exact),
        vocab_size=cfg.model.vocab_size,
        max_sequence_length=cfg.model.seq_length,
        pre_process=ps.is_pipeline_first_stage(),  # pp > 1: this stage's layers only (global layer numbers)
        post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=False,
        position_embedding_type="none" if "attention" in exact else "rope",  # rope inside ExactCoreAttention
        rotary_base=int(cfg.model.rotary_base),
        rotary_percent=cfg.model.rotary_percent,
    )
    if exact:
        from moe_rl.learner.exact_spec import install_exact_hooks  # noqa: PLC0415  imports Megatron (lazy here)

        rot_dim = int(cfg.model.kv_channels * cfg.model.rotary_percent)
        install_exact_hooks(model, cfg.model.rotary_base, rot_dim, exact)
        model.moe_rl_exact = "log_softmax" in exact  # read by moe_rl.learner.logprobs.uses_exact
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model


def unwrap(model):
    """The bare ``GPTModel`` under DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


def attention_mask(input_ids: torch.Tensor, segment_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Boolean mask ``masked[B|1, 1, T, T]`` (True = may not attend) for ``input_ids[B, T]``.

    Causal; with ``segment_ids[B, T]`` (packed batch, one id per sequence) also
    block-diagonal. Megatron 0.16 would build its default causal mask on "cuda",
    so the CPU path always passes one explicitly.
    """
    _B, T = input_ids.shape
    future = torch.ones(T, T, dtype=torch.bool, device=input_ids.device).triu(1)
    if segment_ids is None:
        return future.view(1, 1, T, T)
    if segment_ids.shape != input_ids.shape:
        raise ValueError(f"segment_ids must have shape {tuple(input_ids.shape)} [B, T]; got {tuple(segment_ids.shape)}")
    other_segment = segment_ids[:, :, None] != segment_ids[:, None, :]
    return (future[None] | other_segment)[:, None]


def packed_position_ids(segment_ids: torch.Tensor) -> torch.Tensor:
    """``position_ids[B, T]`` restarting at 0 at each new value of ``segment_ids[B, T]``."""
    B, T = segment_ids.shape
    idx = torch.arange(T, device=segment_ids.device).expand(B, T)
    starts = torch.ones_like(segment_ids, dtype=torch.bool)
    starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    start_pos = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values
    return idx - start_pos


def forward_logits(
    model,
    input_ids: torch.Tensor,
    *,
    segment_ids: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run the model: ``input_ids[B, T]`` -> ``logits[B, T, V/tp]`` (vocab-sharded when tp > 1).

    ``padding_mask[B, T]`` (True = padding, Megatron's convention) keeps pad tokens out of the
    routers' aux / z losses and expert-bias token counts.

    Inputs may live on any device: they are moved to the model's parameters' device (no copy when
    already there). Padded batches need nothing extra (right padding never influences earlier
    tokens under the causal mask). Packed batches pass ``segment_ids[B, T]``:
    attention stays within a sequence and positions restart per sequence.
    """
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [B, T]; got shape {tuple(input_ids.shape)}")
    device = model_device(model)
    input_ids = input_ids.to(device)
    segment_ids = None if segment_ids is None else segment_ids.to(device)
    position_ids = None if position_ids is None else position_ids.to(device)
    if position_ids is None:
        if segment_ids is None:
            T = input_ids.shape[1]
            position_ids = torch.arange(T, device=input_ids.device).expand_as(input_ids)
        else:
            position_ids = packed_position_ids(segment_ids)
    if segment_ids is not None and use_transformer_engine():
        raise NotImplementedError(
            "packed batches (segment_ids) use an explicit block-diagonal mask, which the Transformer "
            "Engine spec's causal attention ignores; pad the batch instead (THD PackedSeqParams not wired yet)"
        )
    if device.type == "cuda" and segment_ids is None:
        mask = None  # Megatron builds its causal mask on the GPU (TE ignores masks for causal attention)
    else:
        mask = attention_mask(input_ids, segment_ids)
    extra = {} if padding_mask is None else {"padding_mask": padding_mask.to(device=input_ids.device, dtype=torch.bool)}
    return model(input_ids=input_ids, position_ids=position_ids, attention_mask=mask, **extra)


def moe_routers(model) -> list:
    """The ``TopKRouter`` of each MoE decoder layer, in layer order (dense layers skipped)."""

    routers = []
    for layer in unwrap(model).decoder.layers:
        router = getattr(layer.mlp, "router", None)
        if isinstance(router, TopKRouter):
            routers.append(router)
    return routers
