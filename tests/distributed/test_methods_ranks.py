"""Every method trains on saved records at 1 and 2 ranks with equal metrics (issue 54, Show item 2).

Two torchrun launches (``methods_worker.py``), 1 rank and 2 ranks (gloo, dp=2), each building the trainer once
and looping in-process over every registered ``loss.type``, every ``advantage.estimator`` and the correction
masks of ``methods_table`` (one step each from the same saved records and the same initial weights; weights,
optimizer and RNG reset between methods). The 1-rank run takes each minibatch of 8 as one microbatch, each of
the 2 ranks its 4 samples as one microbatch: a loss normalised by its local microbatch, or a statistic of the
local rows only, gives another gradient and fails. Plus three real ``moe-rl train`` runs (token-level CISPO,
sequence-level GSPO, the survey's VESPO; 2 steps, no server) on the same records, whose first step must be the
loop's. All five launches share the machine at once.

Records: the committed tiny_cpu records with μ moved by N(0, 0.1) nats per token (``shifted_records``), so each
mask removes part of the batch. Tolerance: that of tests/train/test_step_equality.py (relative 1e-5 or absolute
2e-6: float summation order only), for every metric of every method. One metric is sensitive to the microbatch
grouping itself: in bypass mode ``offpolicy/chi2_seq_raw`` is exp(2 Σ_t log(π_θ/μ)) − 1 over sequences of up to
16 tokens, read on minibatch 2's π_θ (after update 1), whose weights carry the float noise of the grouping; the
sum of 16 log-probs, doubled and exponentiated, lifts it to ~1e-5 absolute. Measured at 1 rank: micro_batch_size
8 vs 2 differ by 1.06e-5 (2.2x the tolerance), 8 vs the 2-rank run's 4 by 0.72x the tolerance. Should it exceed
the tolerance, it is compared with a 1-rank twin at the 2-rank run's grouping (micro_batch_size 4), so only the
ranks differ, at the same tolerance.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from moe_rl.algo import adv_estimator_names, policy_loss_names
from moe_rl.config import save_config
from moe_rl.records import RolloutBatch
from moe_rl.train.metrics_log import read_metrics
from moe_rl.train.plan import plan_step
from tests.conftest import one_gpu_per_rank, repo_env
from tests.distributed.methods_table import (
    A3PO_STEP,
    ACTS,
    REFUSED,
    a3po_token_versions,
    method_config,
    methods,
    shifted_records,
)
from tests.distributed.torchrun import REPO, run_worker
from tests.train.records_fixture import initial_hf_dir

pytestmark = [pytest.mark.distributed, one_gpu_per_rank(2)]
REL, ABS = 1e-5, 2e-6  # tests/train/test_step_equality.py's
PER_RANK = ("records/read_bytes_max",)  # each rank reads its share
GROUPING_NOISE = {("corr/bypass", "offpolicy/chi2_seq_raw"), ("corr/bypass_tis", "offpolicy/chi2_seq_raw")}
ONE_RANK_MICRO, TWO_RANK_MICRO = 8, 4  # a minibatch of 8: one microbatch on 1 rank, one of 4 on each of 2 ranks
CLI_METHODS = ("loss/cispo", "loss/gspo", "loss/vespo")  # token-level, sequence-level, a survey loss
WORKER = REPO / "tests" / "distributed" / "methods_worker.py"


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("methods")
    return shifted_records(tmp / "records"), initial_hf_dir(tmp / "hf"), tmp


def _loop(inputs, nproc: int, micro: int, *extra: str) -> dict:
    records, hf, tmp = inputs
    work = tmp / f"ranks{nproc}"
    work.mkdir()
    args = ["--work", str(work), "--records", str(records), "--hf", str(hf), "--micro-batch-size", str(micro)]
    run_worker(WORKER, *args, *extra, nproc=nproc, timeout=400)
    return json.loads((work / "result.json").read_text())


def _cli(inputs, name: str) -> list[dict]:
    """``moe-rl train`` on the method's config file (2 steps: the records' two), 1 rank, no server."""
    records, hf, tmp = inputs
    out = tmp / name.replace("/", "_")
    cfg = method_config(name, records, hf, out, micro_batch_size=ONE_RANK_MICRO)
    cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"steps": 2})})
    config = save_config(cfg, out.with_suffix(".yaml"))
    proc = subprocess.run(
        [sys.executable, "-m", "moe_rl.cli", "train", str(config)],
        capture_output=True,
        text=True,
        timeout=400,
        env=repo_env(REPO, OMP_NUM_THREADS="1"),
        check=False,
    )
    assert proc.returncode == 0, f"moe-rl train {name} failed:\n{proc.stderr[-4000:]}"
    return read_metrics(out / "metrics.jsonl")


@pytest.fixture(scope="module")
def runs(inputs):
    """(1-rank loop, 2-rank loop, {method: the CLI run's rows}), all launched at once (7 processes, 2 cores)."""
    twins = [f"{m}@micro{TWO_RANK_MICRO}" for m in sorted({m for m, _ in GROUPING_NOISE})]
    with ThreadPoolExecutor(5) as pool:
        two = pool.submit(_loop, inputs, 2, TWO_RANK_MICRO)
        one = pool.submit(_loop, inputs, 1, ONE_RANK_MICRO, "--also", *twins)
        cli = {name: pool.submit(_cli, inputs, name) for name in CLI_METHODS}
        return one.result(), two.result(), {name: f.result() for name, f in cli.items()}


@pytest.fixture(scope="module")
def loops(runs):
    return runs[:2]


def _differences(a: dict, b: dict) -> dict:
    keys = {k for k in a.keys() | b.keys() if not k.startswith(PER_RANK)}
    return {
        k: (a.get(k), b.get(k))
        for k in sorted(keys)
        if k not in a or k not in b or not math.isclose(a[k], b[k], rel_tol=REL, abs_tol=ABS)
    }


def test_every_registered_method_ran_and_only_the_unplumbed_ones_were_refused(loops):
    for res in loops:
        assert set(res["refused"]) == set(REFUSED), res["refused"]
        for name, fragment in REFUSED.items():
            assert fragment in res["refused"][name], res["refused"][name]
        ran = {name for name in res["metrics"] if "@" not in name}
        assert ran == set(methods()) - set(REFUSED), ran ^ (set(methods()) - set(REFUSED))
        assert {f"loss/{t}" for t in policy_loss_names()} <= ran
        assert {f"adv/{e}" for e in adv_estimator_names()} <= ran | set(REFUSED)


def test_every_method_gives_the_same_step_at_one_and_two_ranks(loops):
    one, two = (res["metrics"] for res in loops)
    bad = {}
    for name in sorted(two):
        diff = _differences(one[name], two[name])
        for key in [k for k in diff if (name, k) in GROUPING_NOISE]:  # same grouping: 1 rank vs 2 ranks only
            twin = one[f"{name}@micro{TWO_RANK_MICRO}"][key]
            assert math.isclose(twin, two[name][key], rel_tol=REL, abs_tol=ABS), (name, key, twin, two[name][key])
            del diff[key]
        if diff:
            bad[name] = diff
    assert not bad, f"methods whose step differs between 1 and 2 ranks: {bad}"


def test_every_metric_is_finite_and_each_correction_acts(loops):
    for res in loops:
        for name, row in res["metrics"].items():
            assert all(math.isfinite(v) for v in row.values()), (name, {k: v for k, v in row.items()})
            assert row["train/grad_norm"] > 0, (name, row["train/grad_norm"])
    one = loops[0]["metrics"]
    acted = {name: one[name][key] for name, key in ACTS.items()}
    assert all(0 < v < 1 for v in acted.values()), acted


def test_the_reset_between_methods_repeats_the_first_method_bit_for_bit(loops):
    for res in loops:
        first = next(iter(res["metrics"]))
        assert res["repeat"] == res["metrics"][first]


def test_moe_rl_train_runs_three_methods_and_its_first_step_is_the_loops(runs):
    one = runs[0]["metrics"]
    for name, rows in runs[2].items():
        assert [r["step"] for r in rows] == [1, 2], (name, rows)
        assert all(math.isfinite(v) for r in rows for v in r.values() if isinstance(v, float)), (name, rows)
        first = {k: v for k, v in rows[0].items() if k in one[name]}
        assert not _differences(one[name], first), (name, _differences(one[name], first))


def test_a3po_interpolates_by_each_tokens_version_without_an_old_logprob_pass(inputs, loops):
    """A-3PO (``correction.prox_logp_method: loglinear``) on step 3's records, token j of an n-token response from
    version min(2, 3j // n), trained at weights version 2: alpha = (v_θ − 1 − v_μ) / (v_θ − v_μ) is 1/2 on the
    version-0 tokens (the first ceil(n/3)) and 0 on versions 1 and 2. ``a3po/alpha_mean`` is the step's mean over
    its 2 minibatches of each minibatch's token mean, so by hand: mean_m(Σ_i ceil(n_i/3) / 2 / Σ_i n_i)."""
    records, hf, tmp = inputs
    batch = RolloutBatch.load(records / f"step_{A3PO_STEP:06d}.safetensors")
    lens = batch.response_lens.astype(int)
    assert (a3po_token_versions(batch.response_lens)[: lens[0]] == 0).sum() == -(-lens[0] // 3)
    cfg = method_config("corr/a3po", records, hf, tmp / "unused", micro_batch_size=ONE_RANK_MICRO)
    plan = plan_step(len(batch), minibatches=2, micro_batch_size=8, seed=cfg.train.seed, step=A3PO_STEP)
    want = sum(
        sum(-(-lens[i] // 3) for i in mb.sample_ids) / 2 / lens[list(mb.sample_ids)].sum() for mb in plan.minibatches
    )
    for res in loops:
        row = res["metrics"]["corr/a3po"]
        assert math.isclose(row["a3po/alpha_mean"], want / 2, rel_tol=1e-6), (row["a3po/alpha_mean"], want / 2)
        assert row["a3po/prox_minus_behav_mean"] != 0


def test_a3po_runs_no_extra_forward_unless_a_minibatch_wide_correction_reads_pi_prox(loops):
    """No-grad forwards per step (``learner.forward_logprobs`` calls): a decoupled method 1 (the old-log-prob pass);
    A-3PO none (π_prox from each microbatch's update forward, as AReaL; IcePop's weights from it too); A-3PO with
    M2PO one pre-pass per minibatch (2), since M2PO sorts the whole minibatch's (log ρ)² before its first backward.
    M2PO's budget there masks nothing, so both A-3PO paths must give the same step, metric for metric."""
    for res in loops:
        fwd = res["forwards"]
        assert (fwd["corr/none"], fwd["corr/a3po"], fwd["corr/a3po_prepass"]) == (1, 0, 2), fwd
        deferred, prepass = res["metrics"]["corr/a3po"], res["metrics"]["corr/a3po_prepass"]
        assert prepass["m2po/masked_frac"] == 0
        assert not _differences(deferred, {k: v for k, v in prepass.items() if not k.startswith("m2po/")})
