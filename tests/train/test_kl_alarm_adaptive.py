"""Issue 57 item 1: the adaptive KL alarm (``correction.kl_alarm_factor`` x the running median of ``offpolicy/kl_k3``).

Offline: the committed demo run's 30 steps (``docs/demo/metrics.jsonl``, seed 0, the run `make demo` shipped) give
no alarm; the issue's expert-only foreign push (3e-7 normal, then 7e-4 … 4.2e-3, all under the absolute 1e-2) alarms
at its first step, naming the KL and the median, and the alarmed steps stay out of the median.
Through the trainer (tiny_cpu, the session server behind a proxy, the served-weights check off): someone replacing the
experts under the run's label after the warm-up -- the proxy, right after each of the trainer's labels, so that the
next batch is always generated under them -- is stopped by the adaptive alarm, the absolute one being off.
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
from pathlib import Path

import httpx
import pytest
from safetensors.torch import load_file, save_file

from moe_rl.config import load_config
from moe_rl.learner.hf_init import write_random_hf_checkpoint
from moe_rl.train.kl_alarm import KLAlarm, KLAlarmStop
from moe_rl.train.metrics_log import read_metrics
from tests.conftest import run_to_file
from tests.http_proxy import Proxy

ROOT = Path(__file__).parents[2]
DEMO_METRICS = ROOT / "docs/demo/metrics.jsonl"


def _alarm(**overrides) -> KLAlarm:
    return KLAlarm.from_config(
        load_config(ROOT / "configs/demo.yaml", overrides=[]).correction.model_copy(update=overrides)
    )


def test_the_demo_run_gives_no_false_alarm():
    rows = [json.loads(line) for line in DEMO_METRICS.read_text().splitlines()]
    kls = [r["offpolicy/kl_k3"] for r in rows]
    assert len(kls) == 30
    alarm = _alarm()
    assert (alarm.factor, alarm.recent.maxlen, alarm.warmup) == (100.0, 20, 5)  # the defaults
    fired = [step for step, kl in enumerate(kls, start=1) if alarm.check(step, kl)]
    assert fired == [], fired
    ratio = max(kl / alarm.median() for kl in kls[5:])  # how far below the factor the demo's worst step stays
    print(f"\ndemo: 0 alarms in 30 steps; worst step at {ratio:.1f}x the final median")


def test_the_issues_foreign_experts_alarm_at_their_first_step_and_stay_out_of_the_median(caplog):
    alarm = _alarm(kl_alarm_max_in_row=3)
    normal = [3.1e-7, 2.9e-7, 3.4e-7, 3.0e-7, 2.8e-7, 3.2e-7]
    assert not any(alarm.check(step, kl) for step, kl in enumerate(normal, start=1))
    median = alarm.median()
    with caplog.at_level(logging.WARNING):
        assert alarm.check(7, 7e-4) and alarm.check(8, 2.2e-3)
    assert alarm.median() == median  # the alarmed steps did not enter it
    line = caplog.records[0].getMessage()
    assert line.startswith("kl alarm: step 7 not trained on: offpolicy/kl_k3=0.0007 = ") and "\n" not in line, line
    assert f"its running median {median:.3g} over the last 6 steps" in line, line
    with pytest.raises(KLAlarmStop, match=r"^step 9: offpolicy/kl_k3=0.0042 .*running median 3.05e-07"):
        alarm.check(9, 4.2e-3)

    warming = _alarm()
    assert not any(warming.check(s, kl) for s, kl in enumerate([3e-7, 3e-7, 3e-7, 3e-7], start=1))
    assert not warming.check(5, 7e-4)  # 4 steps in the window: still warming up (kl_alarm_warmup=5)
    assert not _alarm(kl_alarm_factor=None).check(1, 7e-4) and not _alarm(kl_alarm_window=0).why(5e-3)
    exact = _alarm(kl_alarm_warmup=1)  # true on-policy: kl_k3 exactly 0; the floor keeps rounding from alarming
    assert not exact.check(1, 0.0) and not exact.check(2, 1e-9) and exact.check(3, 1e-5)


def _experts_only(src: Path, out: Path) -> Path:
    out.mkdir(parents=True)
    tensors = {k: v for f in sorted(src.glob("*.safetensors")) for k, v in load_file(f).items()}
    save_file({k: v for k, v in tensors.items() if ".mlp.experts." in k}, str(out / "model.safetensors"))
    shutil.copy(src / "config.json", out / "config.json")
    return out


class _Interposer:
    """Replaces the experts right after the trainer labels a new version (a ``Proxy`` hook).

    The trainer generates only once ``/update_weight_version`` has returned, so from the ``after``-th metrics row on
    every batch is generated under the foreign experts (pushed under the label the trainer just set): no race with
    the trainer's own push.
    """

    def __init__(self, upstream: str, experts: Path, metrics: Path, after: int):
        self.upstream, self.experts, self.metrics, self.after = upstream, experts, metrics, after
        self.pushes: list[str] = []

    def __call__(self, path: str, body: bytes, reply: httpx.Response) -> None:
        if path != "/update_weight_version" or reply.status_code != 200:
            return
        if self.metrics.exists() and len(self.metrics.read_text().splitlines()) >= self.after:
            label = json.loads(body)["new_version"]
            push = {"model_path": str(self.experts), "weight_version": label, "flush_cache": True}
            if httpx.post(f"{self.upstream}/update_weights_from_disk", json=push, timeout=600).json().get("success"):
                self.pushes.append(label)


@pytest.mark.sglang
def test_the_adaptive_alarm_stops_a_run_whose_experts_are_replaced_with_digests_off(tiny_cpu_server, tmp_path, device):
    cfg = load_config(ROOT / "configs/tiny_cpu.yaml")
    experts = _experts_only(write_random_hf_checkpoint(cfg.model, tmp_path / "other", seed=77), tmp_path / "experts")
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "moe_rl.cli", "train", str(ROOT / "configs/tiny_cpu.yaml")]
    attack = _Interposer(tiny_cpu_server, experts, out / "metrics.jsonl", after=2)
    proxy = Proxy(tiny_cpu_server, attack)
    cmd += [f"train.output_dir={out}", f"rollout.addresses=[{proxy.url}]", "rollout.check_served_weights=false"]
    cmd += ["train.steps=10", "train.prompts_per_step=4", "rollout.samples_per_prompt=4", "train.micro_batch_size=8"]
    cmd += ["correction.kl_alarm=null", "correction.kl_alarm_warmup=2", "correction.kl_alarm_max_in_row=1"]
    cmd += ["rollout.max_foreign_syncs=20", "checkpoint.save_interval=0", "logging.tensorboard=false"]
    cmd += ["logging.progress=false"]
    out.mkdir()
    with proxy:
        proc, output = run_to_file(cmd, tmp_path / "console.txt", timeout=600)
    pushes = attack.pushes
    assert pushes, "the foreign experts never landed"
    assert proc.returncode == 2 and "Traceback" not in output, output[-4000:]
    (error,) = [line for line in output.splitlines() if line.startswith("error: ")]
    assert "x its running median" in error and "correction.kl_alarm_factor=100" in error, error
    assert "serves digest" not in output  # the digests were off: the alarm caught it (a push may meet the label race)
    rows = read_metrics(out / "metrics.jsonl")
    assert len(rows) >= 2 and all(r["offpolicy/kl_k3"] < 1e-3 for r in rows), rows  # nothing foreign trained on
    step = int(error.split("step ")[1].split(":")[0])
    assert step == len(rows) + 1, (step, len(rows))  # 1-based, as metrics.jsonl
    print(f"\n{len(pushes)} foreign pushes; {error[:240]}")
