"""Issue 16 probes through ``moe-rl train`` (real subprocesses): finished runs, refused resumes, Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import repo_env
from tests.rollout.test_launcher import _pids_mentioning
from tests.train.ops_probes import ShmWatch, shm_left_over, shm_snapshot, start_like_a_terminal

ROOT = Path(__file__).parents[2]
CONFIG = str(ROOT / "configs/tiny_cpu.yaml")
BASE = ["train.steps=2", "logging.tensorboard=false", "logging.progress=false"]
ENV = repo_env(ROOT)
MAKE_FINISHED_RUN = """
import sys
from pathlib import Path
from moe_rl.config import load_config, save_config
from moe_rl.learner.checkpoint import save_checkpoint
from moe_rl.learner.dist import init_distributed
from moe_rl.learner.train_step import Learner
cfg = load_config(sys.argv[1], sys.argv[2:])
init_distributed(cfg.parallel)
run = Path(cfg.train.output_dir)
save_checkpoint(Learner(cfg), run / "checkpoints", extra={"rl_step": 2}, step=2)
save_config(cfg, run / "config.yaml")
"""


def _train(run_dir: Path, *overrides: str, timeout: float = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "moe_rl.cli", "train", CONFIG, *BASE, f"train.output_dir={run_dir}", *overrides]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=ENV, check=False)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A run dir whose checkpoint is at RL step 2 = train.steps (built by a real learner)."""
    run = tmp_path_factory.mktemp("finished")
    subprocess.run(
        [sys.executable, "-c", MAKE_FINISHED_RUN, CONFIG, *BASE, f"train.output_dir={run}"],
        check=True,
        env=ENV,
        timeout=300,
        capture_output=True,
    )
    return run


def test_finished_run_says_nothing_to_do_without_starting_a_server(finished_run):
    proc = _train(finished_run)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "nothing to do (run complete at step 2" in proc.stdout
    assert not (finished_run / "logs").exists(), "a rollout server was started"
    assert not (finished_run / "metrics.jsonl").exists()


def test_a_model_shape_change_fails_before_config_yaml_is_written(finished_run):
    saved = (finished_run / "config.yaml").read_bytes()
    proc = _train(finished_run, "model.moe_ffn_hidden_size=32", "train.steps=3", "checkpoint.allow_changes=[model.*]")
    assert proc.returncode != 0 and "size mismatch" in proc.stderr, proc.stderr[-3000:]
    assert (finished_run / "config.yaml").read_bytes() == saved  # the refused run never rewrote it


@pytest.mark.sglang
@pytest.mark.parametrize(
    ("sig", "rc", "line"),
    [(signal.SIGINT, 130, "interrupted (Ctrl-C)"), (signal.SIGTERM, 143, "terminated (SIGTERM)")],
    ids=["ctrl_c", "sigterm"],
)
def test_a_stop_signal_during_server_start_exits_with_one_line_and_a_clean_state(tmp_path, sig, rc, line):
    """Ctrl-C (SIGINT to the terminal's group) and ``kill``'s SIGTERM alike: one line, no traceback, the server
    stopped, the lock released, nothing left in /dev/shm. Break tried: without the SIGTERM handler in ``cli.main`` the
    trainer died with -15 and an empty stderr, its server left to the orphan guard."""
    before = shm_snapshot()
    cmd = [sys.executable, "-m", "moe_rl.cli", "train", CONFIG, *BASE, f"train.output_dir={tmp_path}"]
    # its own foreground group with SIGINT at its default, as in a terminal: started from a parent that
    # ignores SIGINT (`make test &`) it would inherit SIG_IGN and the "Ctrl-C" below would be lost
    proc = start_like_a_terminal(cmd, ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    watch = ShmWatch(proc.pid)
    watch.start()
    log = tmp_path / "logs" / "sglang_0.log"
    deadline = time.monotonic() + 240
    while not (log.exists() and log.stat().st_size > 0) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert log.exists(), "the server never started"
    time.sleep(2.0)
    os.killpg(proc.pid, sig)  # what Ctrl-C sends / what `kill` sends (the trainer's group only: not its server's)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == rc, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1].startswith(line)
    assert _pids_mentioning(str(tmp_path)) == [], "the rollout server outlived the trainer"
    assert (tmp_path / ".moe_rl.lock").read_text() == ""  # released
    assert shm_left_over(before, watch.stop()) == [], "a /dev/shm entry outlived the interrupted run"


def test_the_e2e_trainer_starts_with_sigint_at_its_default_even_from_a_parent_that_ignores_it():
    """The cause of the lost Ctrl-C (exit 0, empty stderr in a clean-clone `make test`): a parent ignoring
    SIGINT passes SIG_IGN to the trainer, whose Python then never raises KeyboardInterrupt."""
    probe = [
        sys.executable,
        "-c",
        "import signal; print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)",
    ]
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as in a background job of a non-interactive shell
    try:
        inherited = subprocess.run(probe, capture_output=True, text=True, env=ENV, check=False).stdout.strip()
        child = start_like_a_terminal(probe, ENV, stdout=subprocess.PIPE, text=True)
        out, _ = child.communicate(timeout=60)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert inherited == "False"  # what the old Popen gave the trainer under `make test &`
    assert out.strip() == "True"
