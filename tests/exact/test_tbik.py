"""TBIK-style (tensor-parallel-invariant) reductions of the exact kernels: a row-parallel linear split over tp
ranks equals the tp=1 kernel bit for bit when both sides split K at the same fixed block boundaries and
combine the fp32 partials in the same fixed order (``kernels.linear(..., tp_blocks=)`` / ``combine_partials``).

Each "rank" below holds its block of the weight as its own contiguous tensor, as a tensor-parallel shard does.
The kernels are the CPU contract of ``rollout.true_on_policy`` (docs/true_on_policy.md), so the tensors are
built on the CPU whatever the ``device`` fixture says.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moe_rl.config import load_config
from moe_rl.exact import kernels as K
from moe_rl.learner.model import transformer_config_kwargs
from tests.exact.conftest import GATE

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu.yaml"

DTYPES = [torch.float32, torch.bfloat16]
SHAPES = [(96, 64), (64, 2048)]  # (N, K): a small K and one where MKL blocks the reduction


def _shards(x: torch.Tensor, w: torch.Tensor, tp: int):
    """Each rank's input columns and weight columns (row-parallel: the K dimension split), contiguous."""
    b = x.shape[-1] // tp
    return [(x[:, j * b : (j + 1) * b].contiguous(), w[:, j * b : (j + 1) * b].contiguous()) for j in range(tp)]


def _inputs(dtype, n_out, k, seed=20):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(37, k, generator=gen).to(dtype), torch.randn(n_out, k, generator=gen).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tp", [2, 4])
def test_split_gemm_with_fixed_order_combine_equals_the_tp1_kernel_bitwise(dtype, tp):
    """Each rank's partial (its K block through the tiled GEMM, fp32), combined in ascending rank order and
    rounded once, equals the unsharded kernel with ``tp_blocks=tp`` -- for the whole batch and row by row."""
    for n_out, k in SHAPES:
        x, w = _inputs(dtype, n_out, k)
        partials = [K.linear(xs, ws, torch.float32) for xs, ws in _shards(x, w, tp)]
        sharded = K.combine_partials(partials, dtype)
        whole = K.linear(x, w, tp_blocks=tp)
        assert sharded.dtype == whole.dtype == dtype
        assert torch.equal(sharded, whole), (n_out, k)
        rows = torch.cat([K.linear(x[i : i + 1], w, tp_blocks=tp) for i in range(x.shape[0])])
        assert torch.equal(rows, whole), (n_out, k)  # still row-invariant
        assert torch.allclose(whole.float(), x.float() @ w.float().T, rtol=2e-2, atol=2e-1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_column_split_equals_the_unsharded_kernel_bitwise(dtype):
    """A column-parallel linear needs no combine: each rank's output columns (its rows of the weight) equal the
    unsharded kernel's same columns, so q/k/v, fc1 and a vocab-parallel LM head shard exactly."""
    for n_out, k in SHAPES:
        x, w = _inputs(dtype, n_out, k, seed=21)
        whole = K.linear(x, w, torch.float32)
        half = n_out // 2
        cols = [K.linear(x, w[j * half : (j + 1) * half].contiguous(), torch.float32) for j in range(2)]
        assert torch.equal(torch.cat(cols, dim=-1), whole), (n_out, k)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_naive_split_is_not_the_tp1_kernel(dtype):
    """What a tp=2 learner computes without TBIK against a tp=1 server differs: the split partials against the
    unsplit kernel (another reduction order over K); and in bf16, Megatron's all-reduce of partials already
    rounded to the model dtype against the fp32 combine rounded once."""
    n_out, k = SHAPES[1]
    x, w = _inputs(dtype, n_out, k, seed=22)
    partials = [K.linear(xs, ws, torch.float32) for xs, ws in _shards(x, w, 2)]
    assert not torch.equal(K.combine_partials(partials, dtype), K.linear(x, w))
    if dtype == torch.bfloat16:
        rounded_then_summed = partials[0].to(dtype) + partials[1].to(dtype)
        assert not torch.equal(rounded_then_summed, K.linear(x, w, tp_blocks=2))


def test_tp_blocks_must_divide_k():
    x, w = _inputs(torch.float32, 8, 64)
    with pytest.raises(ValueError, match="tp_blocks=3"):
        K.linear(x, w, tp_blocks=3)


def test_an_exact_learner_at_tp2_builds_without_te_only_with_whole_experts():
    """The exact spec's norms are sequence-parallel capable, so tp=2 builds on CPU (sequence parallel on) with
    ``parallel.etp=1``; with the experts split too (etp defaults to tp) one error names the field; the stock
    local spec still needs TE."""
    kw = transformer_config_kwargs(load_config(TINY, [*GATE[:4], "parallel.tp=2", "parallel.etp=1"]))
    assert kw["tensor_model_parallel_size"] == 2 and kw["sequence_parallel"] and kw["expert_tensor_parallel_size"] == 1
    with pytest.raises(ValueError, match=r"parallel.tp=2 under rollout.true_on_policy needs parallel.etp=1"):
        transformer_config_kwargs(load_config(TINY, [*GATE[:4], "parallel.tp=2"]))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"parallel.tp=2 needs Transformer Engine on a GPU"):
            transformer_config_kwargs(load_config(TINY, ["parallel.tp=2"]))
