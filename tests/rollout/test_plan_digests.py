"""The weight sync's pre-send check compares per-rank plan digests (16 bytes a rank), not the plans themselves.

Each rank digests the names and shapes it will send (``checks.plan_digest``); rank 0 adds them up and compares the
sum with the served model's. Only when they disagree are the plans gathered, once, to say which tensors differ
(``WeightSync._plan_detail``: ``check_shapes``' message); nothing is sent either way. The 2-rank equality of the
sum with a real checkpoint's is checked by every sync of ``tests/rollout/sync_ranks_worker.py`` (ep=2, pp=2).
"""

from __future__ import annotations

from moe_rl.sync.checks import plan_digest
from moe_rl.sync.weight_sync import WeightSync

REFERENCE = {"a.weight": (2, 3), "b.weight": (4,), "c.bias": (4,)}


def _sync(reference=REFERENCE) -> WeightSync:
    return WeightSync("tensor", None, reference=reference)


def _digest_sum(*parts):
    count = sum(len(p) for p in parts)
    return count, sum(plan_digest(p)[1] for p in parts) % (1 << 64)


def test_disjoint_plans_add_up_to_the_whole_and_a_change_anywhere_shows():
    one, two = {"a.weight": (2, 3)}, {"b.weight": (4,), "c.bias": (4,)}
    assert _digest_sum(one, two) == plan_digest(REFERENCE)
    assert _digest_sum(one, {"b.weight": (4,), "c.bias": (5,)}) != plan_digest(REFERENCE)  # a shape
    assert _digest_sum(one, {"b.weight": (4,), "d.bias": (4,)}) != plan_digest(REFERENCE)  # a name
    assert _digest_sum(one, {"b.weight": (4,), "a.weight": (2, 3)}) != plan_digest(REFERENCE)  # twice + missing


def test_matching_digests_pass_and_the_first_sync_without_a_reference_sets_the_next_one():
    ws = _sync()
    parts = [{"a.weight": (2, 3)}, {"b.weight": (4,), "c.bias": (4,)}]
    assert ws._check_plans([(plan_digest(p), None) for p in parts]) is None
    fresh = _sync(reference=None)
    assert fresh._check_plans([(plan_digest(p), None) for p in parts]) is None  # nothing to compare with
    fresh._done("v1")
    assert fresh.plan_digest == plan_digest(REFERENCE)
    assert fresh._check_plans([(plan_digest(parts[0]), None)]) == "detail"  # a rank's tensors went missing


def test_disagreeing_digests_gather_the_plans_once_and_name_the_tensors():
    ws = _sync()
    parts = [{"a.weight": (3, 2)}, {"b.weight": (4,), "c.bias": (4,)}]
    assert ws._check_plans([(plan_digest(p), None) for p in parts]) == "detail"
    assert "a.weight has shape (3, 2), the served model has (2, 3)" in ws._plan_detail(parts)
    missing = [{"a.weight": (2, 3)}, {"b.weight": (4,), "e.weight": (4,)}]
    assert "1 missing (e.g. ['c.bias']), 1 unknown (e.g. ['e.weight'])" in ws._plan_detail(missing)


def test_a_non_finite_tensor_is_named_with_its_rank_before_any_digest_comparison():
    ws = _sync()
    got = ws._check_plans([(plan_digest({"a.weight": (2, 3)}), None), ((2, 0), "b.weight")])
    assert got == "weights to sync: b.weight (rank 1) holds NaN or Inf values; nothing was sent"


def test_without_a_reference_a_sync_unlike_the_last_one_says_so():
    ws = _sync(reference=None)
    ws._check_plans([(plan_digest(REFERENCE), None)])
    ws._done("v1")
    assert "the last sync sent 3; nothing was sent" in ws._plan_detail([{"a.weight": (2, 3)}])
