"""The memory plan against what the real Megatron-Core learner holds on each of 2 ranks (gloo, CPU twins).

The worker (memory_plan_worker.py) builds the learner of the 30B twin (ep=2: dp 2, expert dp 1) and of
the 235B twin (pp=2) and reports, per rank, parameter elements, weight / grad-buffer / optimizer-state
bytes after one step, and the 30B twin's distributed-optimizer shard from Megatron's own range map.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moe_rl.config.memory_plan import data_parallel_sizes, local_params, rank_memory
from tests.conftest import one_gpu_per_rank
from tests.distributed.memory_plan_worker import twin_cfg
from tests.distributed.torchrun import run_worker

pytestmark = [pytest.mark.distributed, one_gpu_per_rank(2)]
WORKER = Path(__file__).with_name("memory_plan_worker.py")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("memplan") / "report.json"
    run_worker(WORKER, "--out", str(out), timeout=240)
    return [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(2)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("twin", ["qwen3_30b_a3b", "qwen3_235b_a22b"])
def test_plan_counts_each_ranks_real_parameters_and_state_bytes(ranks, twin):
    cfg = twin_cfg(twin)
    for report in ranks:
        real = report[twin]
        plan = rank_memory(cfg, world=2, stage=real["stage"])
        assert (real["dp"], real["edp"]) == data_parallel_sizes(cfg, 2)
        assert (plan.dense_params, plan.expert_params) == (real["dense"], real["expert"]), real
        assert plan.weights == real["weight_bytes"] and plan.grads == real["grad_bytes"]
        assert plan.optimizer == real["optimizer_bytes"], real  # torch AdamW on fp32 params: two moments
    if twin == "qwen3_235b_a22b":  # the two stages differ (embedding vs output layer + final norm)
        assert {r[twin]["stage"] for r in ranks} == {0, 1}


@pytest.mark.timeout(300)
def test_distributed_optimizer_shards_dense_over_dp_and_experts_over_expert_dp(ranks):
    cfg = twin_cfg("qwen3_30b_a3b", "optim.use_distributed_optimizer=true")
    dp, edp = data_parallel_sizes(cfg, 2)
    params = local_params(cfg, 0)
    for kind, total, group in (("dense", params.dense, dp), ("expert", params.expert, edp)):
        shards = [r["distributed_shard_30b"][kind] for r in ranks]
        assert all(s["group"] == group for s in shards), shards
        assert sum(s["shard"] for s in shards) == total * (2 // group)  # every element in exactly one shard
        padding = shards[0]["buffer"] - total  # Megatron pads the buffer to a multiple of dp (and 64-element starts)
        for s in shards:
            assert abs(s["shard"] - total / group) <= padding, (kind, s, total / group)
    # the plan's optimizer bytes are exactly the shard sizes' bytes up to that padding
    plan = rank_memory(cfg, world=2, stage=0)
    assert plan.optimizer == pytest.approx(8 * (params.dense / dp + params.expert / edp))


@pytest.mark.timeout(300)
def test_distributed_optimizer_state_after_a_step_matches_the_plan(ranks):
    built = ranks[0]["distributed_optimizer_30b"]["built"]
    if built != "DistributedOptimizer":
        pytest.skip(
            f"the learner builds {built} for optim.use_distributed_optimizer=true: Megatron's distributed "
            "optimizer lands with issue 34's learner change (branch h34); this check runs once it has"
        )
    cfg = twin_cfg("qwen3_30b_a3b", "optim.use_distributed_optimizer=true")
    plan = rank_memory(cfg, world=2, stage=0)
    padding = ranks[0]["distributed_shard_30b"]["dense"]["buffer"] - plan.dense_params
    for report in ranks:  # fp32 params: the shards are views of the params; Adam's two fp32 moments per element
        assert abs(report["distributed_optimizer_30b"]["optimizer_bytes"] - plan.optimizer) <= 8 * padding, report
