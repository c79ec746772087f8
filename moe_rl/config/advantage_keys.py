"""Preflight rule: ``advantage.*`` settings the trainer cannot run, or that the chosen estimator never reads.

Owns the table of which estimator-specific keys each ``advantage.estimator`` reads (verl's names), and the
estimators whose inputs the training step does not produce yet: ``remax`` (a greedy response's reward per
prompt, ``reward_baselines``), ``optimal_token_baseline`` / ``tir_optimal_token_baseline`` (Σ_v π_v² per
token from the learner's old-log-prob pass), ``gdpo`` with ``gdpo_reward_keys`` (per-sample reward
components). Their functions exist in ``moe_rl.algo`` (docs/algo.md); a run selecting them is refused up
front, naming what is missing. A key is refused only when given *and* different from its schema default,
as in ``loss_keys``.
"""

from __future__ import annotations

from collections.abc import Iterable

# advantage.estimator -> the estimator-specific AdvantageConfig keys it reads
ADVANTAGE_READS: dict[str, tuple[str, ...]] = {
    "grpo_passk": ("norm_adv_by_std_in_grpo",),
    "gdpo": ("norm_adv_by_std_in_grpo", "gdpo_reward_keys", "gdpo_reward_weights"),
    "optimal_token_baseline": ("handle_zero_tail",),
    "tir_optimal_token_baseline": ("handle_zero_tail",),
}
ESTIMATOR_SPECIFIC = tuple(sorted({k for keys in ADVANTAGE_READS.values() for k in keys}))

# estimator -> what the training step does not pass it yet
NOT_WIRED: dict[str, str] = {
    "remax": "a greedy response's reward per prompt (reward_baselines), which the rollout does not generate yet",
    "optimal_token_baseline": "Σ_v π_v² per token from the learner's old-log-prob pass, which the learner does "
    "not compute yet",
    "tir_optimal_token_baseline": "Σ_v π_v² per token from the learner's old-log-prob pass, which the learner "
    "does not compute yet",
}


def _given(section, key: str) -> bool:
    return key in section.model_fields_set and getattr(section, key) != type(section).model_fields[key].default


def advantage_settings(cfg) -> Iterable[str]:
    """One message per advantage setting a run cannot use."""
    adv = cfg.advantage
    if adv.estimator in NOT_WIRED:
        yield (
            f"advantage.estimator={adv.estimator!r} needs {NOT_WIRED[adv.estimator]}; expected another estimator "
            "(its function is moe_rl.algo's, callable on its own: docs/algo.md)"
        )
    if adv.estimator == "gdpo" and adv.gdpo_reward_keys:
        yield (
            f"advantage.gdpo_reward_keys={adv.gdpo_reward_keys}: per-sample reward components are not carried to "
            "the trainer yet (the reward's extra keys are only averaged into reward/<key>); expected no "
            "gdpo_reward_keys (GDPO on the one reward: whitened GRPO)"
        )
    reads = set(ADVANTAGE_READS.get(adv.estimator, ()))
    for key in ESTIMATOR_SPECIFIC:
        if key not in reads and _given(adv, key):
            readers = ", ".join(e for e, keys in ADVANTAGE_READS.items() if key in keys)
            yield (
                f"advantage.{key}={getattr(adv, key)} is ignored by advantage.estimator={adv.estimator!r}; "
                f"expected no advantage.{key} (only {readers} read it)"
            )
