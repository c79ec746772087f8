"""ReMax end to end on the session's SGLang server: one greedy response per prompt, scored, never trained on.

``advantage.estimator: remax`` makes the rollout add one greedy (temperature 0) response per prompt, whose reward
becomes the records' ``reward_baselines`` (A = r − b, verl's ``compute_remax_outcome_advantage``). Checked here:
the batch maker's baselines equal the reward of a greedy response asked from the server by a plain HTTP request
(not through moe_rl's client) and scored by the run's reward; the greedy response is not in the records; and a
2-step ``moe-rl train`` with remax trains, with its records carrying a baseline per sample, equal within a group.
"""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import numpy as np
import pytest

from moe_rl.config import load_config
from moe_rl.records import RolloutBatch
from moe_rl.rollout.client import RolloutClient
from moe_rl.source.batch_maker import BatchMaker
from moe_rl.source.rollout_worker import PromptSide
from moe_rl.source.step_records import StepRecords
from moe_rl.train.metrics_log import read_metrics
from tests.conftest import run_to_file

pytestmark = pytest.mark.sglang

ROOT = Path(__file__).parents[2]
CONFIG = ROOT / "configs" / "tiny_cpu.yaml"
SMALL = ["train.prompts_per_step=4", "rollout.samples_per_prompt=4", "rollout.max_new_tokens=6"]


def _greedy_http(url: str, prompt_ids, max_new_tokens: int) -> list[int]:
    body = {
        "input_ids": [int(t) for t in prompt_ids],
        "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens},
    }
    reply = httpx.post(f"{url}/generate", json=body, timeout=120)
    reply.raise_for_status()
    return [int(t) for t in reply.json()["output_ids"]]


def test_batch_maker_baselines_are_the_greedy_responses_rewards(tmp_path, tiny_cpu_server):
    small = ["train.prompts_per_step=2", "rollout.samples_per_prompt=3", "rollout.max_new_tokens=6"]
    cfg = load_config(CONFIG, overrides=[*small, "advantage.estimator=remax", f"rollout.addresses=[{tiny_cpu_server}]"])
    n, prompts = cfg.rollout.samples_per_prompt, cfg.train.prompts_per_step
    side = PromptSide.build(cfg, None)
    client = RolloutClient.from_config(cfg, [tiny_cpu_server])
    served = client.generate([[1, 2, 3]], 1, seeded=False)[0].weight_version  # whatever the session server holds
    maker = BatchMaker(
        cfg, side.samples, StepRecords(cfg.model, "remax-test"), tmp_path, client, lambda s: served,
        resync=lambda v: None, weight_sync=lambda: None, restart=None,
    )  # fmt: skip
    batch = RolloutBatch.load(maker(0, 0))
    assert len(batch) == prompts * n  # the greedy responses are not records
    baselines = batch.reward_baselines()
    assert baselines is not None and baselines.shape == (prompts * n,)
    assert batch.extra["reward_metrics"]["reward/greedy_mean"] == pytest.approx(baselines.mean())

    items = PromptSide.build(cfg, None).prompts.next_prompts(0, prompts, round=0)  # the same stream, fresh
    greedy = []
    for g, item in enumerate(items):
        assert np.array_equal(batch.sample(g * n).prompt_ids, item.ids)
        greedy.append(_greedy_http(tiny_cpu_server, item.ids, cfg.rollout.max_new_tokens))
    expected = np.asarray(side.rewarder.score(items, greedy).rewards, dtype=np.float32).astype(np.float64)
    assert np.array_equal(baselines.reshape(prompts, n), np.repeat(expected[:, None], n, axis=1)), (baselines, expected)
    sampled = {tuple(batch.sample(i).response_ids) for i in range(len(batch))}
    assert len(sampled) > 1  # the records hold the sampled responses (temperature 1), not the greedy one


def test_moe_rl_train_with_remax_two_steps(tmp_path, tiny_cpu_server):
    out = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "moe_rl.cli", "train", str(CONFIG), *SMALL,
        "advantage.estimator=remax", "train.steps=2", "train.micro_batch_size=8",
        "logging.tensorboard=false", "logging.progress=false",
        f"train.output_dir={out}", f"rollout.addresses=[{tiny_cpu_server}]",
    ]  # fmt: skip
    proc, output = run_to_file(cmd, tmp_path / "console.txt", timeout=900)
    assert proc.returncode == 0, output[-4000:]
    metrics = read_metrics(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    for step, m in enumerate(metrics):
        batch = RolloutBatch.load(out / "rollouts" / f"step_{step:06d}.safetensors")
        assert len(batch) == 16
        b = batch.reward_baselines().reshape(4, 4)
        assert (b == b[:, :1]).all(), b  # one greedy reward per prompt
        assert m["reward/greedy_mean"] == pytest.approx(b.mean())
        assert np.isfinite(m["loss/total"]) and m["train/grad_norm"] > 0, m
