"""Weight-version labels: ``step-<s>`` and ``step-<s>-<nonce>`` (the run nonce from the run id), both read alike."""

from __future__ import annotations

import pytest

from moe_rl.sync.integrity import (
    WeightVersionError,
    check_weight_versions,
    parse_version_label,
    version_label,
    version_number,
)
from moe_rl.train.run_identity import new_run_id, version_nonce


def test_both_label_forms_parse_to_the_same_version_number():
    assert version_label(7) == "step-7"
    assert version_label(7, "a1b2c3d4") == "step-7-a1b2c3d4"
    for label in ("step-7", "step-7-a1b2c3d4"):
        assert version_number(label) == 7
    assert parse_version_label("step-12-a1b2c3d4") == (12, "a1b2c3d4", False)
    assert parse_version_label("step-12-a1b2c3d4.partial") == (12, "a1b2c3d4", True)
    assert parse_version_label("step-3") == (3, None, False)
    for bad in ("", "attacker", "step-", "step-x", "step-1-", "step-1-AB", "12"):
        with pytest.raises(ValueError, match="step-<s> or step-<s>-<nonce>"):
            parse_version_label(bad)


def test_the_nonce_follows_the_run_id_and_tells_runs_apart():
    run_a, run_b = new_run_id(), new_run_id()
    assert version_nonce(run_a) == version_nonce(run_a)  # a resumed run labels alike
    assert version_nonce(run_a) != version_nonce(run_b)
    assert len(version_nonce(run_a)) == 8 and version_label(3, version_nonce(run_a)).startswith("step-3-")


def test_another_runs_weights_at_the_same_step_are_refused_and_named():
    ours, theirs = version_label(4, version_nonce("aaaaaaaaaaaa")), version_label(4, version_nonce("bbbbbbbbbbbb"))
    check_weight_versions([ours, ours], ours)
    with pytest.raises(WeightVersionError, match=r"1 of 2 samples carry weight_version .*another run's weights"):
        check_weight_versions([ours, theirs], ours)
    with pytest.raises(WeightVersionError, match=r"'step-3-\w+' x1 \(an older sync\)"):
        check_weight_versions([ours, version_label(3, ours.split("-")[2])], ours)
    with pytest.raises(WeightVersionError, match=r"'step-4' x1 \(no run nonce\)"):
        check_weight_versions(["step-4"], ours)
