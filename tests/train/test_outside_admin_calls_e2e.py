"""Issue 57 item 3: an outside admin call during a run is handled by one rule per call, never a traceback.

A ``moe-rl train`` run (tiny_cpu, on the session's tiny_cpu server as a user's own server) while a thread holding the
server's admin access (the session server has no keys: its admin endpoints are open) calls, each right after one of the
run's pushes (the abort once the batch after it is in flight: ``/flush_cache`` is refused then, and flushes the cache
otherwise: harmless, nothing to handle):

* ``/update_weight_version {"new_version": ...}``: SGLang aborts the requests in flight and relabels the weights; the
  aborted requests are sent again and the batch comes back under the foreign label: a label mismatch, re-synced under
  the run's own label (counted against ``rollout.max_foreign_syncs``);
* ``/abort_request {"abort_all": true}``: the aborted requests are sent again (counted);
* ``/pause_generation``: the health watchdog finds the server paused by no one in the run and resumes it.

Each outcome logs one line; the run ends with rc 0, every step trained, no traceback.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from moe_rl.train.metrics_log import read_metrics
from tests.conftest import repo_env

pytestmark = pytest.mark.sglang

ROOT = Path(__file__).parents[2]
FOREIGN = "outside-admin-label"
# (endpoint, body, what the console shows once the run handled it)
CALLS = [
    ("update_weight_version", {"new_version": FOREIGN}, FOREIGN),  # named in the re-sync's line
    ("abort_request", {"abort_all": True}, "sent again"),
    ("pause_generation", {"mode": "abort"}, "resumed it"),
]


def _label(http: httpx.Client, url: str) -> str | None:
    """The served label; None while a push is half-way (``.partial``) or the server cannot say."""
    try:
        label = http.get(f"{url}/model_info").json().get("weight_version")
    except (httpx.HTTPError, ValueError):
        return None
    return None if str(label).endswith(".partial") else label


def _busy(http: httpx.Client, url: str, notes: Counter) -> bool:
    """True while the server has requests running or waiting: SGLang refuses ``/flush_cache`` then (and flushes the
    cache otherwise: the cache-flush rule, harmless)."""
    status = http.post(f"{url}/flush_cache").status_code
    notes[f"flush_cache {status}"] += 1
    return status != 200


def _outsider(url: str, console: Path, trainer: subprocess.Popen, done: list[str], notes: Counter) -> None:
    """Each call of ``CALLS`` right after one of the run's pushes (a new label), when its next batch is about to be
    generated (the version change and the pause act on it whenever it comes); the abort once that batch is in flight
    (``_busy``, for up to 10 s). A call is made again after the next push until the console shows it handled: one
    that lands between a batch and the next push has nothing to act on."""

    def alive() -> bool:
        return trainer.poll() is None

    def handled_lines(mark: str) -> int:
        return console.read_text(errors="replace").count(mark)

    with httpx.Client(timeout=60) as http:
        label = _label(http, url)
        for path, body, mark in CALLS:
            for _ in range(4):
                while alive() and _label(http, url) in (label, FOREIGN, None):  # the run's next push
                    threading.Event().wait(0.01)
                label, before, deadline = _label(http, url), handled_lines(mark), time.monotonic() + 10
                while (
                    path == "abort_request" and alive() and time.monotonic() < deadline and not _busy(http, url, notes)
                ):
                    pass
                if not alive():
                    return
                try:
                    notes[f"{path} {http.post(f'{url}/{path}', json=body).status_code}"] += 1
                except httpx.HTTPError as err:
                    notes[f"{path} {type(err).__name__}"] += 1
                while alive() and handled_lines(mark) == before and _label(http, url) in (label, FOREIGN, None):
                    threading.Event().wait(0.05)  # until handled, or the run pushed again (the chance is gone)
                if handled_lines(mark) > before:
                    done.append(path)
                    break


@pytest.mark.timeout(900)
def test_an_outside_version_change_abort_and_pause_during_a_run_are_handled_without_a_traceback(
    tmp_path, tiny_cpu_server
):
    run, console = tmp_path / "run", tmp_path / "console.txt"
    cmd = [
        sys.executable,
        "-m",
        "moe_rl.cli",
        "train",
        str(ROOT / "configs/tiny_cpu.yaml"),
        "train.steps=5",
        "train.prompts_per_step=4",
        "rollout.samples_per_prompt=4",
        "rollout.max_new_tokens=16",
        "train.micro_batch_size=8",
        "checkpoint.save_interval=0",
        "logging.tensorboard=false",
        "logging.progress=false",
        f"train.output_dir={run}",
        f"rollout.addresses=[{tiny_cpu_server}]",
    ]
    done: list[str] = []
    notes: Counter = Counter()  # HTTP statuses (and errors) the outsider saw: the failure message shows them
    with open(console, "w") as fh:
        t0 = time.monotonic()
        trainer = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=repo_env(ROOT))
        outsider = threading.Thread(
            target=_outsider, args=(tiny_cpu_server, console, trainer, done, notes), daemon=True
        )
        outsider.start()
        try:
            trainer.wait(timeout=600)
        finally:
            if trainer.poll() is None:
                trainer.kill()
        outsider.join(timeout=60)
        httpx.post(f"{tiny_cpu_server}/continue_generation", json={}, timeout=60)  # the session server stays usable
    out = console.read_text(errors="replace")
    assert trainer.returncode == 0, out[-4000:]
    assert "Traceback" not in out, out[-6000:]
    assert done == [c[0] for c in CALLS], (done, notes, out[-4000:])
    # in the batch (its replies carry the label: re-synced) or caught by the push's read-back (pushed again)
    resync = [line for line in out.splitlines() if FOREIGN in line and ("re-syncing" in line or "again" in line)]
    assert resync and "(1/2)" in resync[0], out[-4000:]  # counted against rollout.max_foreign_syncs (2)
    assert any("aborted" in line and "sent again" in line for line in out.splitlines()), out[-4000:]
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 6))
    print(f"\ntrainer {time.monotonic() - t0:.0f} s; step_s {[round(r['time/step_s'], 1) for r in rows]}")
    print(notes, "\n" + "\n".join(line for line in out.splitlines() if "outside" in line or FOREIGN in line))
