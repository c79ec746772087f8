"""Preflight refuses ``loss.*`` keys the chosen loss never reads, naming the key to use (one case per rule)."""

from __future__ import annotations

from pathlib import Path

import pytest

from moe_rl.config import dump_config, load_config
from moe_rl.preflight import config_problems

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu.yaml"
CLIP_READERS = "ppo_clip, gspo, gspo_token, gmpo, dppo_tv, dppo_kl, clip_cov, aspo"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["loss.type=cispo", "loss.clip_low=0.1"],
            (
                "loss.clip_low=0.1 is ignored by loss.type='cispo'; expected loss.cispo_clip_low (CISPO's lower clip; "
                "None = no lower bound)"
            ),
        ),
        (
            ["loss.type=cispo", "loss.cispo_clip_high=4.0", "loss.clip_high=0.5"],
            (
                "loss.clip_high=0.5 is ignored by loss.type='cispo' while loss.cispo_clip_high=4.0 is set; expected only "
                "loss.cispo_clip_high"
            ),
        ),
        (
            ["loss.type=ppo_clip", "loss.cispo_clip_low=0.1"],
            "loss.cispo_clip_low=0.1 is ignored by loss.type='ppo_clip'; expected loss.clip_low",
        ),
        (
            ["loss.type=dppo_tv", "loss.dual_clip_c=3.0"],
            (
                "loss.dual_clip_c=3.0 is ignored by loss.type='dppo_tv'; expected loss.dppo_ratio_cap (DPPO's truncation "
                "of the ratio; verl's clip_ratio_c)"
            ),
        ),
        (
            ["loss.type=ppo_clip", "loss.dppo_ratio_cap=3.0"],
            "loss.dppo_ratio_cap=3.0 is ignored by loss.type='ppo_clip'; expected loss.dual_clip_c",
        ),
        (
            ["loss.type=sapo", "loss.clip_high=0.3"],
            (
                "loss.clip_high=0.3 is ignored by loss.type='sapo'; expected loss.sapo_tau_pos (SAPO's soft gate has no "
                "clip bounds)"
            ),
        ),
        (
            ["loss.type=kl_cov", "loss.clip_cov_ratio=0.01"],
            "loss.clip_cov_ratio=0.01 is ignored by loss.type='kl_cov'; expected loss.kl_cov_ratio",
        ),
        (
            ["loss.type=clip_cov", "loss.kl_cov_ratio=0.01"],
            "loss.kl_cov_ratio=0.01 is ignored by loss.type='clip_cov'; expected loss.clip_cov_ratio",
        ),
        (
            ["loss.type=kl_cov", "loss.clip_low=0.1"],
            (
                "loss.clip_low=0.1 is ignored by loss.type='kl_cov'; expected loss.kl_cov_coef (KL-Cov has no ratio clip; "
                "its penalty is the constraint)"
            ),
        ),
        (
            ["loss.type=reinforce", "loss.clip_low=0.1"],
            (
                f"loss.clip_low=0.1 is ignored by loss.type='reinforce'; expected no loss.clip_low (only loss.type "
                f"{CLIP_READERS} read it)"
            ),
        ),
        (
            ["loss.type=gspo", "loss.kl_cov_coef=0.5"],
            (
                "loss.kl_cov_coef=0.5 is ignored by loss.type='gspo'; expected no loss.kl_cov_coef (only loss.type kl_cov "
                "read it)"
            ),
        ),
        (
            ["loss.norm_len=16"],
            (
                "loss.norm_len=16 is ignored by loss.aggregation='token_mean'; expected "
                "loss.aggregation='seq_mean_token_sum_norm' (the only one with a fixed length normaliser) or no norm_len"
            ),
        ),
    ],
)
def test_ignored_loss_key_is_refused_with_the_key_to_use(overrides, message):
    assert config_problems(load_config(overrides=overrides)).problems == [message]


def test_switching_tiny_cpu_to_cispo_names_its_gspo_clip_low():
    # tiny_cpu.yaml sets GSPO's clip_low/clip_high; CISPO reads clip_high (no cispo_clip_high) but never clip_low
    assert config_problems(load_config(TINY, ["loss.type=cispo"])).problems == [
        (
            "loss.clip_low=0.0003 is ignored by loss.type='cispo'; expected loss.cispo_clip_low (CISPO's lower clip; "
            "None = no lower bound)"
        )
    ]


def test_keys_the_loss_reads_and_a_resolved_dump_pass(tmp_path):
    for overrides in (
        ["loss.type=cispo", "loss.cispo_clip_low=0.1", "loss.clip_high=0.5"],
        ["loss.type=dppo_kl", "loss.dppo_ratio_cap=3.0", "loss.clip_low=0.1"],
        ["loss.aggregation=seq_mean_token_sum_norm", "loss.norm_len=16"],
    ):
        cfg = load_config(overrides=overrides)
        assert config_problems(cfg).problems == [], overrides
        # `moe-rl config show` / a run's config.yaml set every key, the unused ones at their defaults
        dumped = tmp_path / "resolved.yaml"
        dumped.write_text(dump_config(cfg))
        assert config_problems(load_config(dumped)).problems == [], overrides
