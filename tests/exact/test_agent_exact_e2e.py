"""The trainer's agent path in sync mode (issue 56 item 2 and its exactness oracle): ``moe-rl train`` with
``rollout.agent`` trains on two-turn trajectories exactly, never on environment tokens, and the same saved
multi-turn records train alike at 1 and 2 ranks.

One ``moe-rl train`` run: tiny_cpu as shipped (Keep Sampling Mask on, top-p 0.95, top-k 20, R3) under the exact
gate's fp32 true-on-policy settings (tests/exact/conftest.py), on the session's true-on-policy server, with the
two-turn agent of ``tests/exact/trajectory_agent.py`` (turn 1, three environment tokens, turn 2): every step's
``offpolicy/log_ratio_abs_max``, ``offpolicy/kl_k3`` and both ``replay/rollout_vs_natural`` flip rates are 0.0
(the learner replays the stitched routes of every position of every turn). The saved records hold the trajectory
arrays; the environment tokens carry no loss, no kept set, no behaviour log-prob and no version, and the learner's
mask leaves them out. Then the saved records train again at 2 ranks (``train.rollouts_from``, no server): the
learner's metrics equal the agent run's (1 rank), to the tolerance of tests/train/test_step_equality.py.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from moe_rl.config import load_config
from moe_rl.records import RolloutBatch
from moe_rl.records.summary import batch_summary
from moe_rl.train.batching import build_microbatch, response_row_mask
from tests.conftest import one_gpu_per_rank
from tests.exact.conftest import GATE
from tests.exact.test_true_on_policy_e2e import EXACT_KEYS, _train
from tests.exact.trajectory_agent import ENV

pytestmark = pytest.mark.sglang

ROOT = Path(__file__).parents[2]
AGENT = "rollout.agent=tests.exact.trajectory_agent:two_turns"
SHORT = "rollout.max_new_tokens=4"  # tiny_cpu's own: two turns of the gate's 8 would double the (slow) exact decode
REL, ABS = 1e-5, 2e-6  # tests/train/test_step_equality.py's
# not the learner's: timings, the records' reads and provenance (the 2-rank run reads another run's records)
NOT_COMPARED = ("time/", "records/")


@pytest.fixture(scope="module")
def agent_run(tmp_path_factory, tiny_server):
    out = tmp_path_factory.mktemp("agent_exact")
    metrics = _train(
        out, "tiny_cpu.yaml", "replay.keep_sampling_mask=true", SHORT, f"rollout.addresses=[{tiny_server}]", AGENT
    )
    return out, metrics, sorted(out.rglob("step_*.safetensors"))


def test_two_turn_trajectories_train_exactly_in_sync_mode(agent_run):
    _, metrics, records = agent_run
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        got = {k: m.get(k) for k in EXACT_KEYS}  # absent: the KL alarm skipped the step
        assert all(v == 0.0 for v in got.values()), f"step {m['step']}: not exact: {got}"
        assert m["agent/turns_mean"] == 2.0 and m["agent/trajectories"] == 8
    assert len(records) == 2
    for path in records:
        summary = batch_summary(RolloutBatch.load(path))
        assert summary["format_version"] == 4 and summary["turns"] == {"min": 2, "max": 2, "mean": 2.0}
        assert summary["environment_tokens"] == 8 * len(ENV)


def test_environment_tokens_carry_no_loss_kept_set_log_prob_or_version(agent_run):
    _, _, records = agent_run
    batch = RolloutBatch.load(records[0])
    cfg = load_config(ROOT / "configs" / "tiny_cpu.yaml", GATE)
    env = batch.role_mask == 0
    assert env.sum() == len(batch) * len(ENV) and batch.loss_mask.tolist() == batch.role_mask.tolist()
    assert (batch.rollout_logp[env] == 0.0).all() and (batch.sampling_logp[env] == 0.0).all()
    assert (batch.token_versions[env] == -1).all() and (batch.token_versions[~env] == 0).all()
    sizes = np.diff(batch.mask_offsets)
    assert (sizes[env] == 0).all() and (sizes[~env] >= 1).all()  # KSM: generated tokens only
    assert (batch.rollout_logp[~env] < 0).any()
    for i in range(len(batch)):
        s = batch.sample(i)
        turn1 = int((s.turn_ids == 1).sum()) - len(ENV)
        assert s.role_mask.tolist() == [1] * turn1 + [0] * len(ENV) + [1] * (len(s.response_ids) - turn1 - len(ENV))
        assert s.response_ids[turn1 : turn1 + len(ENV)].tolist() == ENV
        assert len(s.routes) == len(s.prompt_ids) + len(s.response_ids) - 1  # a route for every position
    ids = list(range(len(batch)))
    width = int(batch.response_lens.max())
    rows = response_row_mask(batch, ids, width)  # the learner's loss mask as response rows
    mb = build_microbatch(
        batch,
        ids,
        torch.zeros(len(batch)),
        num_experts=cfg.model.num_moe_experts,
        kept_logp=True,
        with_kept_sets=True,
    )
    ends = np.cumsum(batch.response_lens)
    for b, i in enumerate(ids):
        role = batch.role_mask[ends[i] - batch.response_lens[i] : ends[i]].astype(bool)
        assert rows[b, : len(role)].numpy().tolist() == role.tolist() and not rows[b, len(role) :].any()
        P = int(batch.prompt_lens[i])
        assert mb.tensors["mask"][b, P - 1 : P - 1 + len(role)].numpy().tolist() == role.tolist()
        assert int(mb.tensors["mask"][b].sum()) == int(role.sum())


@pytest.mark.distributed
@one_gpu_per_rank(2)
def test_saved_multi_turn_records_train_alike_at_one_and_two_ranks(agent_run, tmp_path):
    """The 1-rank run is the agent run itself (it trained on these records, 2 microbatches of 4); the 2-rank run
    trains from them with no server, each rank its 4 samples as one microbatch."""
    _, one, records = agent_run
    two = _train(
        tmp_path / "two",
        "tiny_cpu.yaml",
        "replay.keep_sampling_mask=true",
        SHORT,
        f"train.rollouts_from={records[0].parent}",
        nproc=2,
    )
    assert [m["step"] for m in one] == [m["step"] for m in two] == [1, 2]
    for a, b in zip(one, two):
        keys = sorted(
            k
            for k in a
            if k in b and isinstance(a[k], float) and not k.startswith(NOT_COMPARED) and not k.endswith("_per_s")
        )
        assert {"loss/total", "offpolicy/log_ratio_abs_max", "train/grad_norm"} <= set(keys), keys
        bad = {k: (a[k], b[k]) for k in keys if not math.isclose(a[k], b[k], rel_tol=REL, abs_tol=ABS)}
        assert not bad, f"step {a['step']}: 1 rank != 2 ranks: {bad}"
