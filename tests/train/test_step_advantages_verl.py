"""The trainer's advantage step runs verl's estimators a run may select (gpg, grpo_passk, gdpo) on saved records.

``step_advantages`` is what the loop calls after the old-log-prob pass; GDPO's whitening must see the
response lengths (verl whitens over the response tokens), which only the trainer supplies.
"""

from __future__ import annotations

import pytest
import torch

from moe_rl.algo import compute_advantages
from moe_rl.config import load_config
from moe_rl.records import RolloutBatch
from moe_rl.train.update import step_advantages
from tests.train.records_fixture import CONFIG, RECORDS, SHAPE


@pytest.mark.parametrize("estimator", ["gpg", "grpo_passk", "gdpo"])
def test_step_advantages_runs_the_verl_estimators(estimator):
    cfg = load_config(CONFIG, [*SHAPE, f"advantage.estimator={estimator}"])
    batch = RolloutBatch.load(RECORDS / "step_000000.safetensors")
    g = torch.Generator().manual_seed(0)  # the committed rewards are mostly 0: spread them
    rewards = torch.rand(len(batch), generator=g, dtype=torch.float64).round(decimals=1)
    adv = step_advantages(cfg, batch, rewards, None, 16)
    lengths = torch.as_tensor(batch.response_lens.astype("int64"))
    assert adv.shape == (len(batch),) and adv.dtype == torch.float32 and bool(adv.abs().sum() > 0)
    expected = compute_advantages(cfg.advantage, rewards, cfg.rollout.samples_per_prompt, lengths=lengths)
    torch.testing.assert_close(adv, expected.float())
    if estimator == "gdpo":  # token-weighted whitening: the lengths change the result
        unweighted = compute_advantages(cfg.advantage, rewards, cfg.rollout.samples_per_prompt)
        assert float((expected - unweighted).abs().max()) > 1e-3
