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
from moe_rl.learner.hf_init import write_random_hf_checkpoint
from moe_rl.sizing import job_plan
from moe_rl.sizing.terms import hf_tensors_read
from tests.conftest import one_gpu_per_rank
from tests.distributed.memory_plan_worker import twin_cfg
from tests.distributed.plan_measured_worker import LAYOUTS, job_cfg, write_step_records
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


# ----------------------------------------------------------------------------------- host, disk and network terms
# The job plan (moe_rl.sizing) against what the real learner writes, sends, reads and allocates on each of 2 ranks
# (plan_measured_worker.py measures; nothing there calls the plan): ep=2, and dp=2 with the distributed optimizer.
MEASURED = Path(__file__).with_name("plan_measured_worker.py")


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("planmeasured")
    cfg = job_cfg("ci", "ep2")
    write_random_hf_checkpoint(cfg.model, tmp / "hf", seed=0, dtype="bfloat16")
    write_step_records(tmp / "step_000000.safetensors", cfg)
    out = tmp / "report.json"
    args = ("--out", str(out), "--scratch", str(tmp), "--records", str(tmp / "step_000000.safetensors"))
    run_worker(MEASURED, *args, timeout=240)
    return [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(2)]


def within(measured: float, planned: float, tol: float) -> bool:
    return abs(planned - measured) <= tol * measured


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_plan_predicts_each_ranks_measured_disk_network_records_and_hf_import_bytes(measured, layout):
    cfg = job_cfg("ci", layout)
    plan = job_plan(cfg, world=2)
    rank_plan = plan.ranks[0]
    rows = []
    for r, report in enumerate(measured):
        real = report[layout]
        assert real["dp"] == 2, real
        rows += [
            (f"rank {r} checkpoint bytes", sum(real["checkpoint_files"].values()), rank_plan.checkpoint_bytes, 0.10),
            (f"rank {r} records bytes read", real["records_read"], rank_plan.host["records"], 0.10),
            (f"rank {r} HF import RssAnon peak", real["hf_import_rss_anon"], rank_plan.host["hf_import"], 0.25),
            (f"rank {r} HF import bytes read", real["hf_import_read"], rank_plan.hf_read_bytes, 0.10),
            (f"rank {r} HF tensors read", real["hf_tensors"], hf_tensors_read(cfg, 0), 0.0),
        ]
    step = [
        ("records bytes per step", measured[0][layout]["records_file"], plan.records_step_bytes),
        ("tensor sync bytes per step", sum(m[layout]["sync_tensor_sent"] for m in measured), plan.weight_sync_bytes),
        (
            "disk sync bytes per step",
            sum(sum(m[layout]["sync_disk_files"].values()) for m in measured),
            plan.weight_sync_bytes,
        ),
    ]
    rows += [(*row, 0.10) for row in step]
    table = "\n".join(
        f"  {what}: measured {real:,} planned {int(p):,} ({p / real - 1:+.1%})" for what, real, p, _ in rows
    )
    bad = [what for what, real, p, tol in rows if not within(real, p, tol)]
    assert not bad, f"{layout}: plan outside the tolerance for {bad}:\n{table}"
