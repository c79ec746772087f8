"""Issue 16, items 4/5: one trainer per output directory, resume rules, writable paths (real files, real processes)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from moe_rl.config import load_config, save_config
from moe_rl.train.resume_rules import RunDirError
from moe_rl.train.run_dir import RunLock, guard_run_dir
from moe_rl.train.run_identity import write_checkpoint_identity, write_run_id
from tests.conftest import repo_env

HOLD_LOCK = "import sys, time; from moe_rl.train.run_dir import RunLock; RunLock(__import__('pathlib').Path(sys.argv[1])).acquire(); print('locked', flush=True); time.sleep(600)"


def _cfg(run_dir: Path, *overrides: str):
    return load_config(None, [f"train.output_dir={run_dir}", *overrides])


def _holder(lock_path: Path) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(lock_path)], stdout=subprocess.PIPE, text=True, env=repo_env(os.getcwd())
    )
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_second_trainer_on_the_same_dir_fails_at_once_naming_the_holder(tmp_path, caplog):
    cfg = _cfg(tmp_path)
    holder = _holder(tmp_path / ".moe_rl.lock")
    try:
        t0 = time.monotonic()
        with pytest.raises(
            RunDirError, match=rf"in use by another trainer: pid {holder.pid} on host {socket.gethostname()}"
        ):
            guard_run_dir(cfg, tmp_path, tmp_path / "checkpoints")
        assert time.monotonic() - t0 < 2.0
    finally:
        holder.send_signal(signal.SIGKILL)  # dies holding the lock: a stale lock file stays behind
        holder.wait()
    assert str(holder.pid) in (tmp_path / ".moe_rl.lock").read_text()
    with caplog.at_level("WARNING"):
        lock = guard_run_dir(cfg, tmp_path, tmp_path / "checkpoints")
    assert "stale lock" in caplog.text and f"pid {holder.pid}" in caplog.text
    assert f'"pid": {os.getpid()}' in (tmp_path / ".moe_rl.lock").read_text()
    lock.release()
    assert RunLock(tmp_path / ".moe_rl.lock").acquire()  # released: the next run takes it


def _previous_run(run_dir: Path, *overrides: str):
    cfg = _cfg(run_dir, *overrides)
    save_config(cfg, run_dir / "config.yaml")
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    step = run_dir / "checkpoints" / "step_00000002"
    step.mkdir(parents=True)
    (step / "meta.json").write_text('{"step": 2, "extra": {"rl_step": 2}}')
    return cfg


def test_resume_never_refuses_a_previous_run_unless_overwrite(tmp_path):
    _previous_run(tmp_path)
    with pytest.raises(
        RunDirError,
        match=r"holds a previous run \(config.yaml, metrics.jsonl \(2 lines\), checkpoints at steps \[2\].*checkpoint.overwrite=true",
    ):
        guard_run_dir(_cfg(tmp_path, "checkpoint.resume=never"), tmp_path, tmp_path / "checkpoints")
    assert (tmp_path / "metrics.jsonl").read_text().count("step") == 2  # untouched
    guard_run_dir(
        _cfg(tmp_path, "checkpoint.resume=never", "checkpoint.overwrite=true"), tmp_path, tmp_path / "checkpoints"
    ).release()
    assert not (tmp_path / "metrics.jsonl").exists() and not list((tmp_path / "checkpoints").glob("step_*"))


def test_resume_with_changed_settings_shows_the_diff_and_refuses(tmp_path):
    _previous_run(tmp_path)
    saved = (tmp_path / "config.yaml").read_text()
    with pytest.raises(RunDirError) as info:
        guard_run_dir(
            _cfg(tmp_path, "optim.lr=0.5", "replay.routing=r3", "train.steps=20"), tmp_path, tmp_path / "checkpoints"
        )
    msg = str(info.value)
    assert "! optim.lr: 0.001 -> 0.5" in msg and "! replay.routing: 'none' -> 'r3'" in msg
    assert "  train.steps: 10 -> 20" in msg  # shown, not unsafe
    assert "checkpoint.allow_changes=[optim.lr,replay.routing]" in msg
    assert (tmp_path / "config.yaml").read_text() == saved  # never overwritten by a refused start
    # safe keys only, or unsafe keys explicitly allowed: the run may start
    guard_run_dir(
        _cfg(tmp_path, "train.steps=20", "rollout.request_timeout_s=5", "logging.progress=false"),
        tmp_path,
        tmp_path / "checkpoints",
    ).release()
    guard_run_dir(
        _cfg(tmp_path, "optim.lr=0.5", "checkpoint.allow_changes=[optim.lr]"), tmp_path, tmp_path / "checkpoints"
    ).release()


def test_a_parallel_layout_change_may_resume_and_is_shown(tmp_path, caplog):
    _previous_run(tmp_path, "parallel.ep=2")
    with caplog.at_level("WARNING"):
        guard_run_dir(_cfg(tmp_path, "parallel.ep=1", "parallel.tp=2"), tmp_path, tmp_path / "checkpoints").release()
    assert "parallel.ep: 2 -> 1" in caplog.text and "parallel.tp: 1 -> 2" in caplog.text
    assert "the checkpoint is resharded to the new layout" in caplog.text
    with caplog.at_level("WARNING"):  # issue 34: the optimizer state may move into / out of the distributed optimizer
        guard_run_dir(
            _cfg(tmp_path, "parallel.ep=1", "optim.use_distributed_optimizer=true"), tmp_path, tmp_path / "checkpoints"
        ).release()
    assert "optim.use_distributed_optimizer: False -> True" in caplog.text
    with pytest.raises(RunDirError, match=r"! model.num_moe_experts"):  # everything else stays strict
        guard_run_dir(_cfg(tmp_path, "parallel.ep=1", "model.num_moe_experts=4"), tmp_path, tmp_path / "checkpoints")


def test_a_key_the_previous_run_did_not_have_is_safe_only_at_its_default(tmp_path):
    """Issue 40: a run saved before a key existed behaved as its default; another value is a change."""

    _previous_run(tmp_path)
    tree = yaml.safe_load((tmp_path / "config.yaml").read_text())
    del tree["optim"]["min_lr"]  # an older version of moe_rl had no such key
    del tree["data"]  # nor this section (its default: none)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(tree))
    guard_run_dir(_cfg(tmp_path), tmp_path, tmp_path / "checkpoints").release()  # both at their default
    with pytest.raises(RunDirError, match=r"! optim.min_lr: '<absent>' -> 0.0001"):
        guard_run_dir(_cfg(tmp_path, "optim.min_lr=0.0001"), tmp_path, tmp_path / "checkpoints")


def test_unwritable_checkpoint_dir_is_caught_before_anything_starts(tmp_path):
    (tmp_path / "a_file").write_text("x")
    cfg = _cfg(tmp_path / "run", f"checkpoint.dir={tmp_path / 'a_file' / 'ckpt'}")
    with pytest.raises(RunDirError, match=r"checkpoint.dir=.*a_file/ckpt is not writable: .*\(ENOTDIR\)"):
        guard_run_dir(cfg, tmp_path / "run", Path(cfg.checkpoint.dir))
    assert not (tmp_path / "run" / ".moe_rl.lock").exists()


# ---------------------------------------------------------------- issue 21, item 4: checkpoint.dir and train.steps
def _foreign_checkpoints(ckpt: Path, run_id: str | None, output_dir: Path) -> None:
    step = ckpt / "step_00000003"
    step.mkdir(parents=True)
    (step / "meta.json").write_text('{"step": 3, "extra": {"rl_step": 3}}')
    if run_id is not None:
        write_checkpoint_identity(ckpt, run_id, output_dir)


def test_checkpoints_no_run_in_the_output_dir_wrote_are_refused(tmp_path):
    ckpt = tmp_path / "shared_ckpt"
    _foreign_checkpoints(ckpt, None, tmp_path / "elsewhere")  # written by an unknown run: no identity
    cfg = _cfg(tmp_path / "run", f"checkpoint.dir={ckpt}")
    with pytest.raises(
        RunDirError,
        match=r"checkpoint.dir=.*shared_ckpt holds checkpoints that no run in "
        r"train.output_dir=.*run wrote",
    ):
        guard_run_dir(cfg, tmp_path / "run", ckpt)


def test_checkpoints_of_another_run_are_refused_naming_it(tmp_path):
    ckpt = tmp_path / "shared_ckpt"
    _foreign_checkpoints(ckpt, "aaaaaaaaaaaa", tmp_path / "run_a")
    run_b = tmp_path / "run_b"
    _previous_run(run_b, f"checkpoint.dir={ckpt}")  # run_b has its own config and run id
    write_run_id(run_b, "bbbbbbbbbbbb")
    with pytest.raises(
        RunDirError,
        match=r"holds the checkpoints of run 'aaaaaaaaaaaa' \(train.output_dir=.*run_a\), "
        r"but train.output_dir=.*run_b is run 'bbbbbbbbbbbb'",
    ):
        guard_run_dir(_cfg(run_b, f"checkpoint.dir={ckpt}"), run_b, ckpt)
    # a fresh output dir (no run id) is refused too, and overwrite discards the old run's identity
    with pytest.raises(RunDirError, match=r"is a new run"):
        guard_run_dir(_cfg(tmp_path / "fresh", f"checkpoint.dir={ckpt}"), tmp_path / "fresh", ckpt)
    (ckpt / "reference").mkdir()
    (ckpt / "reference" / "rank_00000.safetensors").write_text("old reference")
    guard_run_dir(
        _cfg(tmp_path / "fresh", f"checkpoint.dir={ckpt}", "checkpoint.resume=never", "checkpoint.overwrite=true"),
        tmp_path / "fresh",
        ckpt,
    ).release()
    assert not (ckpt / "run.json").exists() and not (ckpt / "reference").exists()
    assert not list(ckpt.glob("step_*"))


def test_two_runs_cannot_share_a_checkpoint_dir_at_the_same_time(tmp_path):
    ckpt = tmp_path / "shared_ckpt"
    holder = _holder(ckpt / ".moe_rl.lock")
    try:
        with pytest.raises(
            RunDirError,
            match=rf"checkpoint.dir=.*shared_ckpt is in use by another trainer: "
            rf"pid {holder.pid}",
        ):
            guard_run_dir(_cfg(tmp_path / "run_b", f"checkpoint.dir={ckpt}"), tmp_path / "run_b", ckpt)
        assert not (tmp_path / "run_b" / ".moe_rl.lock").read_text()  # the output dir's lock was let go
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()


def test_train_steps_is_resume_safe_only_with_a_constant_lr_schedule(tmp_path):
    _previous_run(tmp_path, "optim.lr_decay_style=cosine")
    with pytest.raises(RunDirError) as info:
        guard_run_dir(
            _cfg(tmp_path, "optim.lr_decay_style=cosine", "train.steps=20"), tmp_path, tmp_path / "checkpoints"
        )
    msg = str(info.value)
    assert "! train.steps: 10 -> 20" in msg and "optim.lr_decay_style=cosine decays to optim.min_lr" in msg
    assert "checkpoint.allow_changes=[train.steps]" in msg
    guard_run_dir(
        _cfg(tmp_path, "optim.lr_decay_style=cosine", "train.steps=20", "checkpoint.allow_changes=[train.steps]"),
        tmp_path,
        tmp_path / "checkpoints",
    ).release()


def test_a_run_saved_with_the_old_fixed_timeouts_resumes_with_them_derived(tmp_path):
    """Issue 53: rollout.startup_timeout_s / request_timeout_s and launch.signal_lead_s became unset (derived from
    the plan); a run saved with the old fixed values (180, 120, 300) resumes without checkpoint.allow_changes."""
    _previous_run(tmp_path)
    tree = yaml.safe_load((tmp_path / "config.yaml").read_text())
    tree["rollout"] |= {"startup_timeout_s": 180.0, "request_timeout_s": 120.0}
    tree["launch"]["signal_lead_s"] = 300
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(tree))
    guard_run_dir(_cfg(tmp_path), tmp_path, tmp_path / "checkpoints").release()
