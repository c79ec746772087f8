"""The job plan's terms beyond the learner state: each a byte count from the config alone, with its derivation.

Owns the GPU terms ``moe_rl.config.memory_plan`` did not count (TE FP8 weight caches, logits at the real
micro-batch tokens, CUDA/NCCL overhead), the host terms (HF import peak, records per rank, checkpoint write
buffers), the records and weight-sync bytes per step, and the documented constants and bandwidths they use.
Imports ``moe_rl.config`` only (the sizing floor: ``config validate`` runs it on any machine).
"""

from __future__ import annotations

from moe_rl.config.memory_plan import local_params
from moe_rl.config.schema import ExperimentConfig

# CUDA context (~0.6 GB with lazy module loading), cuBLAS/cuDNN workspaces and the NCCL communicators of
# Megatron's ~10 process groups (NCCL_BUFFSIZE 4 MiB x channels x peers each, ~1.5 GB together) on one GPU;
# allocator fragmentation is not counted. A documented round figure until ``make gpu-check`` measures it.
CUDA_NCCL_OVERHEAD = 3.0e9
# logprobs_from_logits (moe_rl/learner/logprobs.py) holds per logit element at its peak, ``exp * shifted``:
# the bf16 logits (2 B) + fp32 ``z`` (4) + ``shifted`` (4) + ``exp`` (4, saved for backward) + ``exp*shifted``
# (4) = 18 bytes.
LOGIT_BYTES = 18
FP8_CACHE_BYTES = 2  # TE's row-wise and column-wise FP8 copies of each weight: 1 + 1 byte per parameter
HF_BYTES = 2  # the HF checkpoints the cluster configs load are bf16 (assumed for every HF import)
PARAM_BYTES = {"float32": 4, "bfloat16": 2}  # precision.params_dtype
# Anonymous memory the HF import keeps per HF tensor it reads until it ends, not attributed further (the reader's
# read log, safetensors slice handles, allocator slack): measured, the slope between the ep=2 and dp=2 imports of
# the 307.5M model (576 more tensors read, 1152 KiB more RssAnon; bench/bench_plan_measured.py).
HF_TENSOR_OVERHEAD = 2048
# One records sample: int32 ids per prompt and response token, fp32 log-prob and int32 weight version per
# response token (moe_rl/records/batch.py); routes uint8 (<= 256 experts) or uint16 per token, MoE layer, top-k.
ID_BYTES, LOGP_BYTES, VERSION_BYTES = 4, 4, 4


def micro_batch_tokens(cfg: ExperimentConfig) -> int:
    """Tokens of one learner micro-batch: ``train.micro_batch_size`` x (prompt + ``rollout.max_new_tokens``).

    The prompt is at most ``data.max_prompt_tokens`` (default ``model.seq_length - max_new_tokens``), and a
    sample never exceeds ``model.seq_length``; a micro-batch is padded to its longest sample, so its worst
    case is every sample at that length.
    """
    return cfg.train.micro_batch_size * sample_tokens(cfg)


def sample_tokens(cfg: ExperimentConfig) -> int:
    """A sample's longest length: prompt (``data.max_prompt_tokens`` or the rest of ``model.seq_length``; a
    task config, with no data section, is sized at the latter) + ``rollout.max_new_tokens``, at most seq_length."""
    m, new = cfg.model, cfg.rollout.max_new_tokens
    limit = cfg.data.max_prompt_tokens if cfg.data is not None else None
    prompt = limit or max(m.seq_length - new, 1)
    return min(prompt + new, m.seq_length)


def logits_bytes(cfg: ExperimentConfig, stage: int) -> float:
    """Last stage only: micro-batch tokens x ``vocab_size / tp`` x ``LOGIT_BYTES`` (18, see above)."""
    if stage != cfg.parallel.pp - 1:
        return 0.0
    return micro_batch_tokens(cfg) * cfg.model.vocab_size / cfg.parallel.tp * LOGIT_BYTES


def linear_params(cfg: ExperimentConfig, stage: int) -> int:
    """Elements of a rank's TE linear weights: its parameters less the embedding, output layer, norms, router.

    These are the layers TE runs in FP8 (attention qkv/proj, dense or shared-expert and expert fc1/fc2).
    """
    m, p = cfg.model, cfg.parallel
    params = local_params(cfg, stage)
    h, kv = m.hidden_size, m.kv_channels
    per_stage = m.num_layers // p.pp
    pattern = m.moe_layer_pattern()[stage * per_stage : (stage + 1) * per_stage]
    norms = 2 * h + (2 * kv if m.qk_layernorm else 0)
    other = sum(norms + (m.num_moe_experts * h if moe else 0) for moe in pattern)
    vocab = m.vocab_size * h // p.tp
    other += (vocab if stage == 0 else 0) + (vocab + h if stage == p.pp - 1 else 0)
    if m.add_qkv_bias:
        other += len(pattern) * kv * (m.num_attention_heads + 2 * m.num_query_groups) // p.tp
    return params.dense + params.expert - other


def fp8_cache_bytes(cfg: ExperimentConfig, stage: int) -> float:
    """TE FP8 weight caches: 2 B per linear weight element, unless FP8 is off or the cache is disabled.

    Megatron passes ``is_first_microbatch`` to TE unless ``disable_parameter_transpose_cache``
    (megatron/core/extensions/transformer_engine.py), so TE keeps a row-wise and a column-wise FP8 copy of
    each weight across the micro-batches of a step (blockwise scales: 1/128 of that, not counted).
    """
    fp8 = cfg.precision.fp8
    if fp8 is None or fp8.disable_parameter_transpose_cache:
        return 0.0
    return float(FP8_CACHE_BYTES * linear_params(cfg, stage))


def largest_local_tensor(cfg: ExperimentConfig) -> int:
    """Elements of the largest tensor a rank holds: the vocab shard, an expert's or the dense MLP's fc1."""
    m, p = cfg.model, cfg.parallel
    etp = p.tp if p.etp is None else p.etp
    h = m.hidden_size
    return max(m.vocab_size * h // p.tp, 2 * m.moe_ffn_hidden_size * h // etp, 2 * m.ffn_hidden_size * h // p.tp)


def hf_import_peak(cfg: ExperimentConfig, stage: int) -> float:
    """Anonymous host bytes the per-rank HF import (learner/hf_import.py) adds at its peak: its largest transient.

    A whole HF tensor comes straight from the memory-mapped file (page cache, reclaimable: this rank's share
    passes through it, ``hf_read_bytes``, but is never held); a tp/etp slice is a copy (``HF_BYTES`` per element);
    a packed tensor (SwiGLU ``linear_fc1``, ``linear_qkv``) is concatenated into a new one; a tensor in another
    dtype than ``precision.params_dtype`` is cast to a further copy. So per element: a plain tensor holds the slice
    (if split) and the cast at once; a packed one the parts (if split) and their concatenation, then the
    concatenation and the cast. Measured within 25% (RssAnon) by tests/distributed/test_memory_plan_ranks.py.
    """
    m, p = cfg.model, cfg.parallel
    etp = p.tp if p.etp is None else p.etp
    h, tp = m.hidden_size, p.tp
    pbytes = PARAM_BYTES[cfg.precision.params_dtype]
    cast = 0 if pbytes == HF_BYTES else pbytes

    def plain(n: int, split: bool) -> float:
        return n * ((HF_BYTES if split else 0) + cast)

    def packed(n: int, split: bool) -> float:
        return n * (HF_BYTES + max(HF_BYTES if split else 0, cast))

    per_stage = m.num_layers // p.pp
    pattern = m.moe_layer_pattern()[stage * per_stage : (stage + 1) * per_stage]
    out = [packed((m.num_attention_heads + 2 * m.num_query_groups) * m.kv_channels * h // tp, tp > 1)]
    if stage == 0 or stage == p.pp - 1:  # embedding / output layer
        out.append(plain(m.vocab_size * h // tp, tp > 1))
    if any(pattern):
        out += [packed(2 * m.moe_ffn_hidden_size * h // etp, etp > 1), plain(m.moe_ffn_hidden_size * h // etp, etp > 1)]
        shared = m.moe_shared_expert_intermediate_size
        if shared:
            out.append(packed(2 * shared * h // tp, tp > 1))
    if not all(pattern):
        out += [packed(2 * m.ffn_hidden_size * h // tp, tp > 1), plain(m.ffn_hidden_size * h // tp, tp > 1)]
    return float(max(out) + HF_TENSOR_OVERHEAD * hf_tensors_read(cfg, stage))


def hf_tensors_read(cfg: ExperimentConfig, stage: int) -> int:
    """HF tensors a rank of ``stage`` reads (learner/hf_convert.py's name map): per layer q, k, v, o, two norms
    (+ q/k norms, + q/k/v biases), and an MLP's gate, up, down (a MoE layer: its local experts' and the shared
    expert's, the router, the expert bias); the embedding on the first stage, final norm and output on the last."""
    m, p = cfg.model, cfg.parallel
    per_stage = m.num_layers // p.pp
    pattern = m.moe_layer_pattern()[stage * per_stage : (stage + 1) * per_stage]
    attention = 6 + (2 if m.qk_layernorm else 0) + (3 if m.add_qkv_bias else 0)
    moe = 1 + int(m.moe_router_enable_expert_bias) + 3 * (m.num_moe_experts // p.ep)
    moe += 3 if m.moe_shared_expert_intermediate_size else 0
    n = sum(attention + (moe if is_moe else 3) for is_moe in pattern)
    return n + (1 if stage == 0 else 0) + (2 if stage == p.pp - 1 else 0)


def checkpoint_write_buffer(cfg: ExperimentConfig) -> float:
    """A save streams one tensor at a time to the host (learner/sharded_state.py ``write_safetensors``):
    the largest local tensor in fp32 (a master or moment copy), 4 B per element."""
    return 4.0 * largest_local_tensor(cfg)


def sample_bytes(cfg: ExperimentConfig) -> float:
    """Bytes of one records sample at its longest (prompt + ``max_new_tokens`` tokens, routes if r3)."""
    m, new = cfg.model, cfg.rollout.max_new_tokens
    tokens = sample_tokens(cfg)
    out = tokens * ID_BYTES + new * (LOGP_BYTES + VERSION_BYTES)
    if cfg.replay.routing == "r3":
        moe_layers = sum(m.moe_layer_pattern())
        out += (tokens - 1) * moe_layers * m.moe_router_topk * (1 if m.num_moe_experts <= 256 else 2)
    return float(out)


def records_bytes_per_step(cfg: ExperimentConfig) -> float:
    """One step's records file: ``prompts_per_step`` x ``samples_per_prompt`` samples at their longest."""
    return cfg.train.prompts_per_step * cfg.rollout.samples_per_prompt * sample_bytes(cfg)


def records_bytes_per_rank(cfg: ExperimentConfig, dp: int) -> float:
    """What one data-parallel rank reads of a step's records (format 3, ``moe_rl/records/share.py``): μ and the
    token versions of every sample (the minibatch-global statistics need them) and ``1/dp`` of the rest (its
    share's token ids and routes)."""
    shared = cfg.rollout.max_new_tokens * (LOGP_BYTES + VERSION_BYTES)
    return cfg.train.prompts_per_step * cfg.rollout.samples_per_prompt * (shared + (sample_bytes(cfg) - shared) / dp)


def total_params(cfg: ExperimentConfig) -> int:
    """Every parameter of the model (one rank of a tp = pp = ep = 1 layout, plus nothing else)."""
    whole = cfg.model_copy(
        update={"parallel": cfg.parallel.model_copy(update={"tp": 1, "pp": 1, "ep": 1, "etp": 1, "cp": 1})}
    )
    p = local_params(whole, 0)
    return p.dense + p.expert


def weight_sync_bytes(cfg: ExperimentConfig) -> float:
    """Tensor bytes one weight sync sends to each rollout server (every sending rank's buckets together): every
    parameter in ``precision.params_dtype`` (the learner streams its live weights; ``rollout.weight_quantization``
    rounds them through FP8 and sends them back in that dtype). The disk transport writes them once, plus each
    file's safetensors header."""
    return float(total_params(cfg) * PARAM_BYTES[cfg.precision.params_dtype])
