"""Partial rollouts without a server: the config keys and their preflight, and the provenance helpers.

The behaviour against a real server (pause, push, continue, per-token oracles) is test_partial_rollouts.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from moe_rl.config import ConfigError, load_config
from moe_rl.preflight import config_problems
from moe_rl.records import RolloutSample
from moe_rl.rollout.client import RolloutClient
from moe_rl.rollout.partial import (
    PartialRolloutError,
    check_pause_mode,
    check_version_spans,
    is_pause_abort,
    is_queued_abort,
    kv_stale_tokens,
    paused_generation,
    stitch,
    token_versions_from_meta,
)
from moe_rl.rollout.replies import RolloutResponseError


def test_pause_mode_is_one_of_three_and_partial_is_off_by_default():
    cfg = load_config()
    assert cfg.rollout.partial is False and cfg.rollout.pause_mode == "retract"
    with pytest.raises(ConfigError) as info:
        load_config(overrides=["rollout.pause_mode=drain"])
    assert "rollout.pause_mode" in str(info.value) and "retract" in str(info.value)
    expected = r"rollout.pause_mode='drain'; expected one of \('retract', 'abort', 'in_place'\)"
    with pytest.raises(ValueError, match=expected):
        check_pause_mode("drain")
    with pytest.raises(ValueError, match="rollout.pause_mode"), paused_generation(["http://127.0.0.1:1"], "drain"):
        pass


def test_partial_rollouts_need_the_async_producer_and_in_place_is_noted_as_approximate():
    problems = config_problems(load_config(overrides=["rollout.partial=true"])).problems
    assert [p for p in problems if p.startswith("rollout.partial=true")], problems
    assert "train.rollout_mode=async" in problems[-1]
    for mode in ("retract", "abort"):
        cfg = load_config(overrides=["rollout.partial=true", f"rollout.pause_mode={mode}"])
        assert config_problems(cfg).notes == []
    notes = config_problems(load_config(overrides=["rollout.partial=true", "rollout.pause_mode=in_place"])).notes
    assert any("in_place is approximate" in n and "async/kv_stale_tokens" in n for n in notes)
    assert config_problems(load_config(overrides=["rollout.pause_mode=in_place"])).notes == []  # partial off


def _spans(*spans):
    listed = [{"version": v, "start": s, "end": e} for v, s, e in spans]
    return {"weight_versions": listed, "weight_version": spans[-1][0]}


def test_token_versions_follow_sglangs_spans():
    tv = token_versions_from_meta(_spans(("step-3-ab1", 0, 4), ("step-4-ab1", 4, 6)), 6)
    assert tv.dtype == np.int32 and tv.tolist() == [3, 3, 3, 3, 4, 4]
    assert token_versions_from_meta({"weight_version": "step-2"}, 3).tolist() == [2, 2, 2]  # no spans: one version
    assert token_versions_from_meta({"weight_version": "default"}, 3) is None  # not a trainer label: the sample's
    with pytest.raises(PartialRolloutError, match="needs trainer labels"):
        token_versions_from_meta(_spans(("default", 0, 2), ("step-1", 2, 3)), 3)
    with pytest.raises(PartialRolloutError, match="do not cover"):
        token_versions_from_meta(_spans(("step-1", 0, 2)), 3)


def test_kv_stale_tokens_are_those_after_the_first_change():
    assert kv_stale_tokens(_spans(("step-1", 0, 5), ("step-2", 5, 9)), 9) == 4
    assert kv_stale_tokens(_spans(("step-1", 0, 9)), 9) == 0


def test_only_a_pause_abort_is_continued():
    assert is_pause_abort({"finish_reason": {"type": "abort", "message": "Aborted", "status_code": None}})
    # a request still queued at the pause: SGLang's TokenizerManager._handle_abort_req fallback, no status_code
    assert is_pause_abort({"finish_reason": {"type": "abort", "message": "Abort in waiting queue"}})
    assert is_queued_abort({"finish_reason": {"type": "abort", "message": "Abort in waiting queue"}})
    assert not is_queued_abort({"finish_reason": {"type": "abort", "message": "Aborted", "status_code": None}})
    assert not is_pause_abort({"finish_reason": {"type": "abort", "message": "Request running timeout reached."}})
    assert not is_pause_abort({"finish_reason": {"type": "abort", "message": "Aborted", "status_code": 400}})
    assert not is_pause_abort({"finish_reason": {"type": "length", "length": 4}})


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_a_server_without_version_spans_is_refused_where_a_request_spans_an_update(mode):
    """Without spans every token would get the reply's last version (counted current): refused, naming the
    server and the mode, also through the client at the first reply; abort and non-partial runs need none."""

    no_spans = {"weight_version": "step-1", "finish_reason": {"type": "length", "length": 2}}
    with pytest.raises(
        PartialRolloutError, match=rf"http://s:1 sends no per-token weight_versions.*pause_mode='{mode}'"
    ):
        check_version_spans(no_spans, mode, "http://s:1")
    check_version_spans(_spans(("step-1", 0, 2)), mode, "http://s:1")
    check_version_spans(no_spans, "abort", "http://s:1")
    check_version_spans(no_spans, None, "http://s:1")
    client = RolloutClient(["http://s:1"], None, 16, return_sampling_mask=False, pause_mode=mode)
    reply = {"output_ids": [3, 4], "meta_info": no_spans}
    with pytest.raises(RolloutResponseError, match="sends no per-token weight_versions"):
        client._to_sample(reply, np.array([1, 2], np.int32), 0, "http://s:1")


def test_stitch_keeps_each_segments_arrays():
    p, k, r2 = 3, 2, 3
    head = RolloutSample(
        prompt_ids=np.arange(p, dtype=np.int32),
        response_ids=np.array([7, 8], np.int32),
        rollout_logp=np.array([-1, -2], np.float32),
        routes=np.zeros((p + k - 1, 1, 2), np.uint8),
        sampling_mask=[np.array([7]), np.array([8])],
        sampling_logp=np.array([-0.1, -0.2], np.float32),
        weight_version="step-0",
        finish_reason="abort",
        token_versions=np.array([0, 0], np.int32),
        group_id=5,
    )
    tail = RolloutSample(
        prompt_ids=np.array([0, 1, 2, 7, 8], np.int32),
        response_ids=np.array([9, 10, 11], np.int32),
        rollout_logp=np.array([-3, -4, -5], np.float32),
        routes=np.ones((r2, 1, 2), np.uint8),
        sampling_mask=[np.array([9]), np.array([10]), np.array([11])],
        sampling_logp=np.array([-0.3, -0.4, -0.5], np.float32),
        weight_version="step-1",
        finish_reason="length",
        token_versions=np.array([1, 1, 1], np.int32),
        group_id=5,
    )
    s = stitch(head, tail)
    assert s.response_ids.tolist() == [7, 8, 9, 10, 11] and s.token_versions.tolist() == [0, 0, 1, 1, 1]
    assert s.routes.shape == (p + k + r2 - 1, 1, 2)
    assert s.routes[: p + k - 1].max() == 0 and s.routes[p + k - 1 :].min() == 1
    assert s.rollout_logp.tolist() == [-1, -2, -3, -4, -5]
    assert [m.tolist() for m in s.sampling_mask] == [[7], [8], [9], [10], [11]]
    assert (s.weight_version, s.finish_reason, s.group_id) == ("step-1", "length", 5)
    with pytest.raises(PartialRolloutError, match="continuation prompt"):
        stitch(
            head,
            RolloutSample(
                prompt_ids=np.arange(4, dtype=np.int32), response_ids=tail.response_ids, rollout_logp=tail.rollout_logp
            ),
        )
