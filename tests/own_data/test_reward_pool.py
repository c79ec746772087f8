"""The reward pool's timeout is each call's own (measured in the worker from the call's start), a
replacement's slow import never blocks dispatch nor costs another call its time, and a reward that
returns something odd (a numpy array) is an error for that call, not a dead worker."""

from __future__ import annotations

import time

import pytest

from moe_rl.reward.pool import RewardPool, _normalise

SLOW_IMPORT = """
import time
time.sleep(3.0)  # a heavy import (sympy, a model): every replacement of a killed worker takes this long
def score(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep(float(solution_str))
    return {"score": 1.0, "slept": float(solution_str)}
"""

ODD = """
import numpy as np
def score(data_source, solution_str, ground_truth, extra_info=None):
    return {"array": np.array([0.5, 0.5]), "f32": np.float32(0.5), "zero_d": np.array(0.25),
            "dict": {"score": np.float32(0.75), "acc": np.float32(1.0), "pred": "7"}}[solution_str]
"""


def calls(*texts):
    return [{"data_source": "d", "solution_str": t, "ground_truth": "g", "extra_info": None} for t in texts]


def test_calls_under_the_limit_finish_beside_a_hanging_one_and_a_slow_replacement(tmp_path):
    """The issue's case: workers import for 3 s, timeout 2 s; a hanging call (60 s), calls well under (0.3 s,
    0.1 s) and just under (1.8 s) the limit, and one over it (2.6 s). The old pool blocked 3 s importing the
    hung worker's replacement and then judged the 1.8 s call, finished meanwhile, as timed out."""
    (tmp_path / "slow_rewards.py").write_text(SLOW_IMPORT)
    pool = RewardPool(f"{tmp_path}/slow_rewards.py:score", num_workers=2, timeout_s=2.0).start()
    try:
        t0 = time.monotonic()
        out = pool.map(calls("60", "0.3", "0.1", "1.8", "2.6"))
        wall = time.monotonic() - t0
        assert [o.error for o in out] == [
            "timed out after reward.timeout_s=2 s",
            None,
            None,
            None,
            "timed out after reward.timeout_s=2 s",
        ]
        assert [o.extras for o in out if o.error is None] == [{"slept": 0.3}, {"slept": 0.1}, {"slept": 1.8}]
        assert wall < 30, wall  # nothing waited for the 60 s call
        assert len(pool._workers) == 2  # both killed workers were replaced (still importing: nobody waited)
    finally:
        pool.close()


def test_a_numpy_return_value_is_an_error_for_its_call_not_a_dead_worker(tmp_path):
    (tmp_path / "odd_rewards.py").write_text(ODD)
    pool = RewardPool(f"{tmp_path}/odd_rewards.py:score", num_workers=1, timeout_s=30.0)
    with pool:
        pid = pool._workers[0].proc.pid
        array, f32, zero_d, as_dict = pool.map(calls("array", "f32", "zero_d", "dict"))
        assert array.error == "returned ndarray of shape (2,); expected a float or a dict with 'score'"
        assert (f32.error, f32.score) == (None, 0.5) and (zero_d.error, zero_d.score) == (None, 0.25)
        assert (as_dict.error, as_dict.score, as_dict.extras) == (None, 0.75, {"acc": 1.0})
        assert pool._workers[0].proc.pid == pid  # the same worker answered every call


@pytest.mark.parametrize(
    "value, why",
    [
        (True, "returned bool"),
        ("0.5", "returned str"),
        ([1.0], "returned list"),
        ({"acc": 1}, "without 'score'"),
        (float("inf"), "non-finite"),
    ],
)
def test_normalise_refuses_what_is_not_one_number(value, why):
    with pytest.raises(ValueError, match=why):
        _normalise(value)
