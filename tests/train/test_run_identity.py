"""The run id: new for a fresh run, kept across a resume, removed by checkpoint.overwrite."""

from __future__ import annotations

from moe_rl.train.resume_rules import discard_previous_run
from moe_rl.train.run_identity import read_run_id, resolve_run_id, write_run_id


def test_fresh_runs_get_distinct_ids_and_a_resume_keeps_its_id(tmp_path, device):
    a, b = resolve_run_id(tmp_path, resumed=False), resolve_run_id(tmp_path, resumed=False)
    assert a != b and len(a) == 12
    write_run_id(tmp_path, a)
    assert resolve_run_id(tmp_path, resumed=True) == a
    assert resolve_run_id(tmp_path, resumed=False) != a  # a fresh start never inherits an old id


def test_overwrite_discards_the_old_runs_id(tmp_path, device):
    write_run_id(tmp_path, "abc")
    (tmp_path / "ckpt").mkdir()
    discard_previous_run(tmp_path, tmp_path / "ckpt")
    assert read_run_id(tmp_path) is None
