"""End-to-end RL on CPU: real SGLang server process + real Megatron-Core learner, through the CLI.

The rollout engine runs in bf16 and the learner in fp32, so routers really disagree and
R3 has something to fix. Each run is a `moe-rl train` subprocess (as a user runs it), on the path
users take: responses of different lengths (up to 12 tokens, EOS-terminated), several
microbatches per minibatch (micro_batch_size 2 of 8), two minibatches per step.

The runs share the session's tiny_cpu server (``rollout.addresses``: a user's own server), as the
trainer's own server would serve them: every run pushes its own weights under its own labels at its
start (a full sync), and a run killed mid-push leaves the server to the next run's full sync.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from moe_rl.records import RolloutBatch
from moe_rl.rollout.orphan_guard import group_pids
from moe_rl.sync.integrity import version_label
from moe_rl.train.metrics_log import read_metrics
from moe_rl.train.run_identity import version_nonce
from tests.conftest import run_to_file

pytestmark = pytest.mark.sglang

ROOT = Path(__file__).parents[2]
BASE = [
    "train.steps=3",
    "train.prompts_per_step=4",
    "rollout.samples_per_prompt=4",
    "train.minibatches_per_step=2",
    "train.micro_batch_size=2",
    "rollout.max_new_tokens=12",
    "rollout.dtype=bfloat16",
    "checkpoint.save_interval=1",
    "logging.tensorboard=false",
    "logging.progress=false",
]
DOCUMENTED_KEYS = {
    "reward/mean",
    "offpolicy/kl_k1",
    "offpolicy/kl_k3",
    "offpolicy/chi2_token",
    "offpolicy/chi2_seq",
    "offpolicy/ess",
    "offpolicy/ppl_ratio",
    "offpolicy/prob_pearson",
    "icepop/masked_frac",
    "replay/rollout_vs_natural/response/flip_rate",
    "replay/rollout_vs_natural/response/tokens_with_flip",
    "replay/rollout_vs_natural/response/flip_rate/layer0",
    "replay/rollout_vs_dispatched/response/flip_rate",
    "replay/rollout_vs_dispatched/prompt/flip_rate",
    "train/grad_norm",
    "loss/total",
    "time/step_s",
    "time/rollout_s",
    "ksm/outside_mask_frac",
}


@pytest.fixture(scope="module")
def server(tiny_cpu_server) -> str:
    return tiny_cpu_server


def train_cmd(out_dir: Path, server: str, *overrides: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "moe_rl.cli",
        "train",
        str(ROOT / "configs/tiny_cpu.yaml"),
        *BASE,
        f"train.output_dir={out_dir}",
        f"rollout.addresses=[{server}]",
        *overrides,
    ]


def _console(out_dir: Path) -> Path:
    """Where a run's output goes (a file: ``tests.conftest.run_to_file`` says why)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    return out_dir.parent / f"{out_dir.name}.console.txt"


def run_train(out_dir: Path, server: str, *overrides: str, timeout: float = 600) -> list[dict]:
    proc, output = run_to_file(train_cmd(out_dir, server, *overrides), _console(out_dir), timeout=timeout)
    assert proc.returncode == 0, f"moe-rl train failed:\n{output[-4000:]}"
    return read_metrics(out_dir / "metrics.jsonl")


@pytest.fixture(scope="module")
def r3_run(tmp_path_factory, server):
    out = tmp_path_factory.mktemp("r3")
    return out, run_train(out, server, "replay.routing=r3")


def test_r3_run_logs_every_documented_metric_each_step(r3_run):
    _, metrics = r3_run
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for m in metrics:
        missing = DOCUMENTED_KEYS - m.keys()
        assert not missing, f"step {m['step']} lacks {sorted(missing)}"
        assert all(v is None or np.isfinite(v) for v in m.values() if isinstance(v, float))


def test_r3_dispatches_rollout_routes_exactly_while_natural_routing_differs(r3_run):
    _, metrics = r3_run
    # compared with the experts Megatron's dispatcher received (tests/replay shows it non-zero when a
    # router escapes replay), over response and prompt positions alike
    for part in ("response", "prompt"):
        assert all(m[f"replay/rollout_vs_dispatched/{part}/flip_rate"] == 0.0 for m in metrics)
    # bf16 engine vs fp32 learner (and weight updates): the learner's own top-k differs somewhere
    assert max(m["replay/rollout_vs_natural/response/flip_rate"] for m in metrics) > 0.0
    assert max(m["response/len_max"] - m["response/len_mean"] for m in metrics) > 0, "responses should be ragged"


def test_rollouts_are_persisted_with_routes_masks_and_versions(r3_run):
    out, _ = r3_run
    files = sorted((out / "rollouts").glob("step_*.safetensors"))
    assert [f.name for f in files] == ["step_000000.safetensors", "step_000001.safetensors", "step_000002.safetensors"]
    batch = RolloutBatch.load(files[1])
    assert len(batch) == 16 and batch.routes is not None and batch.mask_offsets is not None
    assert batch.routes.dtype == np.uint8 and batch.routes.shape[1:] == (2, 2)
    run_id = (out / "run_id").read_text().strip()
    # generated after the first weight sync, labelled with this run's nonce (step-<s>-<nonce>)
    assert set(batch.weight_versions) == {version_label(1, version_nonce(run_id))}
    # issue 28: stamped with the producing run and the model's architecture fingerprint
    assert batch.run_id == run_id
    assert batch.fingerprint["model.num_moe_experts"] == 8 and "tokenizer.vocab" in batch.fingerprint


def test_routing_none_on_the_same_data_reports_natural_flips(tmp_path, r3_run, server):
    _, r3_metrics = r3_run
    metrics = run_train(tmp_path, server, "replay.routing=none", "train.steps=1")
    # step 1 generates the same rollout (same seeds, same initial weights) as the R3 run
    assert metrics[0]["reward/mean"] == r3_metrics[0]["reward/mean"]
    assert metrics[0]["replay/rollout_vs_natural/response/flip_rate"] > 0.0
    # natural routing: what was dispatched is the learner's own choice
    assert (
        metrics[0]["replay/rollout_vs_dispatched/response/flip_rate"]
        == metrics[0]["replay/rollout_vs_natural/response/flip_rate"]
    )


def test_killed_run_resumes_from_checkpoint_with_identical_next_step(tmp_path, r3_run, server):
    _, uninterrupted = r3_run
    latest = tmp_path / "checkpoints" / "latest"
    kill_train_when(
        tmp_path,
        server,
        ["replay.routing=r3"],
        signal.SIGTERM,
        poll_s=0.5,
        ready=lambda: (
            latest.exists() and json.loads((_step_dir(latest) / "meta.json").read_text())["extra"]["rl_step"] >= 1
        ),
    )
    resumed = run_train(tmp_path, server, "replay.routing=r3")
    assert [m["step"] for m in resumed] == [1, 2, 3]
    for before, after in zip(uninterrupted, resumed, strict=True):
        same = {k: v for k, v in before.items() if not k.startswith(("time/", "rollout/tokens_per_s"))}
        assert same == {k: after[k] for k in same}, f"step {before['step']} differs after resume"


def kill_train_when(out_dir: Path, server: str, overrides, sig: int, poll_s: float, ready, group: bool = True) -> float:
    """Start ``moe-rl train`` in its own process group and send ``sig`` to the group (``group=False``: to the trainer
    alone) once ``ready()`` (failing if the run ends first); the group is SIGKILLed whatever happens. Returns the
    seconds until no process of the group was left (at most 30)."""

    console = _console(out_dir).with_suffix(".killed.txt")
    with open(console, "w") as fh:
        proc = subprocess.Popen(
            train_cmd(out_dir, server, *overrides), stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
        )
    deadline = time.time() + 400
    try:
        while time.time() < deadline and proc.poll() is None and not ready():
            time.sleep(poll_s)
        assert proc.poll() is None, f"run ended before it could be killed:\n{console.read_text()[-3000:]}"
        os.killpg(proc.pid, sig) if group else os.kill(proc.pid, sig)
        proc.wait(timeout=60)
        t0 = time.monotonic()
        while group_pids(proc.pid) and time.monotonic() - t0 < 30:
            time.sleep(0.1)
        return time.monotonic() - t0
    finally:
        if group_pids(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)


def _step_dir(latest: Path) -> Path:
    return latest.parent / f"step_{int(latest.read_text()):08d}"


# ---------------------------------------------------------------------------------------------- async rollouts
def _records_arrays(path: Path) -> dict:
    return load_file(str(path))


def test_async_with_zero_staleness_equals_sync_step_for_step(tmp_path, r3_run, server):
    """train.max_staleness=0: the producer makes step s only after version s is pushed, so the records,
    rewards, losses and grad norms are the sync run's, bitwise."""
    sync_dir, sync_metrics = r3_run
    metrics = run_train(tmp_path, server, "replay.routing=r3", "train.rollout_mode=async", "train.max_staleness=0")
    for before, after in zip(sync_metrics, metrics, strict=True):
        same = {k: v for k, v in before.items() if not k.startswith(("time/", "rollout/tokens_per_s"))}
        assert same == {k: after[k] for k in same}, f"step {before['step']} differs from the sync run"
    for s in range(3):
        name = f"rollouts/step_{s:06d}.safetensors"
        a, b = _records_arrays(sync_dir / name), _records_arrays(tmp_path / name)
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a), f"{name} differs"
        assert set(b["token_versions"].tolist()) == {s}


def _shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm"))


def test_async_run_killed_and_resumed_trains_every_step_once_within_the_staleness_bound(tmp_path, server):
    """k = 1, checkpoints every 2 steps, SIGKILL of the trainer alone after the first: its rollout process is gone
    within 10 s; the resumed run trains the batch the checkpoint carried (not a new one), every step once, no token
    is more than 1 version old, and no /dev/shm entry is left behind."""
    # the default correction.kl_alarm stays on: every token from step 2 on is one version old, so its KL holds
    # the policy's own update (kl_k3 ~1e-2 here) and the alarm leaves such steps unchecked (alarm/unchecked)
    args = (
        "replay.routing=r3",
        "train.rollout_mode=async",
        "train.max_staleness=1",
        "train.steps=4",
        "checkpoint.save_interval=2",
    )
    meta = tmp_path / "checkpoints" / "step_00000002" / "meta.json"
    shm_before = _shm_entries()
    left_s = kill_train_when(tmp_path, server, args, signal.SIGKILL, poll_s=0.02, ready=meta.exists, group=False)
    assert left_s < 10, f"a process of the killed trainer (its rollout process) was still alive after {left_s:.1f} s"
    carried = json.loads(meta.read_text())["extra"]["async"]
    assert carried["ready_steps"] == [2], "pushing version 2 waits for step 2's batch, so the checkpoint holds it"
    saved = (meta.parent / "files" / "step_000002.safetensors").read_bytes()
    metrics = run_train(tmp_path, server, *args)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4], "a step is missing or was logged twice"
    assert (tmp_path / "rollouts" / "step_000002.safetensors").read_bytes() == saved, "step 2 was generated again"
    for s in range(4):
        batch = RolloutBatch.load(tmp_path / "rollouts" / f"step_{s:06d}.safetensors")
        assert s - 1 <= batch.token_versions.min() and batch.token_versions.max() <= s, f"step {s}: too stale"
    assert all(m["async/staleness_max"] <= 1 and m["async/dropped_stale"] == 0 for m in metrics)
    assert max(m["async/staleness_mean"] for m in metrics) == 1.0, "k = 1 should train one step behind"
    assert all("time/learner_wait_s" in m and "time/rollout_idle_s" in m for m in metrics)
    assert all("alarm/skipped" not in m for m in metrics)
    # unchecked exactly where no token was fresh (staleness mean 1 with max <= 1); step 1 is always fresh
    assert all((m.get("alarm/unchecked") == 1.0) == (m["async/staleness_mean"] == 1.0) for m in metrics), metrics
    assert _shm_entries() <= shm_before, f"left in /dev/shm: {sorted(_shm_entries() - shm_before)}"


def test_partial_rollout_run_killed_mid_step_leaves_nothing_and_reruns_every_step_once(tmp_path, server):
    """rollout.partial=true (a push pauses the batch in flight and continues it under the new weights), SIGKILL of
    the trainer alone while a step is under way: no process of it is left within 10 s, the rerun trains every step
    once within the staleness bound, and nothing is left in /dev/shm."""
    args = (
        "train.rollout_mode=async",
        "train.max_staleness=1",
        "train.steps=3",
        "checkpoint.save_interval=1",
        "rollout.partial=true",
        "rollout.max_new_tokens=24",
    )
    meta = tmp_path / "checkpoints" / "step_00000001" / "meta.json"
    shm_before = _shm_entries()
    left_s = kill_train_when(tmp_path, server, args, signal.SIGKILL, poll_s=0.02, ready=meta.exists, group=False)
    assert left_s < 10, f"a process of the killed trainer (its rollout process) was still alive after {left_s:.1f} s"
    metrics = run_train(tmp_path, server, *args)
    assert [m["step"] for m in metrics] == [1, 2, 3], "a step is missing or was logged twice"
    assert all(m["async/staleness_max"] <= 1 and m["async/dropped_stale"] == 0 for m in metrics)
    for s in range(3):
        batch = RolloutBatch.load(tmp_path / "rollouts" / f"step_{s:06d}.safetensors")
        assert s - 1 <= batch.token_versions.min() and batch.token_versions.max() <= s, f"step {s}: too stale"
    assert _shm_entries() <= shm_before, f"left in /dev/shm: {sorted(_shm_entries() - shm_before)}"
