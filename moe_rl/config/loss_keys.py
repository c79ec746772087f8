"""Preflight rule: ``loss.*`` keys that the chosen ``loss.type`` (or aggregation) never reads.

Owns the table of which loss-specific keys each ``loss.type`` reads, and the message naming the
key to use instead (``loss.clip_low`` with ``cispo`` -> ``loss.cispo_clip_low``). A key is refused
only when it was given *and* differs from its schema default, so a fully resolved config
(``moe-rl config show``, a run's ``config.yaml``) whose unused keys hold their defaults still loads.
``moe_rl.algo``'s per-loss hyper-parameter models (``moe_rl.algo.registry``) are the code this table describes;
tests/algo/test_registry.py checks that both name the same keys.
"""

from __future__ import annotations

from collections.abc import Iterable

CLIPS = ("clip_low", "clip_high")
COV_CLIP = ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub")
COV_KL = ("kl_cov_ratio", "kl_cov_coef")

# loss.type -> the loss-specific LossConfig keys it reads (the generic ones are read by all).
READS: dict[str, tuple[str, ...]] = {
    "ppo_clip": (*CLIPS, "dual_clip_c"),
    "gspo": CLIPS,
    "gspo_token": CLIPS,
    "cispo": ("cispo_clip_low", "cispo_clip_high", "clip_high"),  # clip_high only while cispo_clip_high is None
    "reinforce": (),
    "sapo": ("sapo_tau_pos", "sapo_tau_neg"),
    "gmpo": CLIPS,
    "dppo_tv": (*CLIPS, "dppo_ratio_cap"),
    "dppo_kl": (*CLIPS, "dppo_ratio_cap"),
    "clip_cov": (*CLIPS, *COV_CLIP),
    "kl_cov": COV_KL,
    "gpg": (),
    "minpro": (),
    "ctpo": ("ctpo_clip_low", "ctpo_clip_high", "ctpo_clip_c", "ctpo_clip_power"),
    "topr": (),
    "oapl": ("oapl_beta",),
    "aspo": (*CLIPS, "aspo_dual_clip_c_pos", "aspo_dual_clip_c_neg"),
    "vespo": ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"),
}
LOSS_SPECIFIC = tuple(sorted({k for keys in READS.values() for k in keys}))

# (loss.type, ignored key) -> what to set instead (text after "expected ").
INSTEAD: dict[tuple[str, str], str] = {
    ("cispo", "clip_low"): "loss.cispo_clip_low (CISPO's lower clip; None = no lower bound)",
    ("ppo_clip", "cispo_clip_low"): "loss.clip_low",
    ("ppo_clip", "cispo_clip_high"): "loss.clip_high",
    ("sapo", "clip_low"): "loss.sapo_tau_neg (SAPO's soft gate has no clip bounds)",
    ("sapo", "clip_high"): "loss.sapo_tau_pos (SAPO's soft gate has no clip bounds)",
    ("dppo_tv", "dual_clip_c"): "loss.dppo_ratio_cap (DPPO's truncation of the ratio; verl's clip_ratio_c)",
    ("dppo_kl", "dual_clip_c"): "loss.dppo_ratio_cap (DPPO's truncation of the ratio; verl's clip_ratio_c)",
    ("ppo_clip", "dppo_ratio_cap"): "loss.dual_clip_c",
    ("kl_cov", "clip_cov_ratio"): "loss.kl_cov_ratio",
    ("clip_cov", "kl_cov_ratio"): "loss.clip_cov_ratio",
    ("kl_cov", "clip_low"): "loss.kl_cov_coef (KL-Cov has no ratio clip; its penalty is the constraint)",
    ("kl_cov", "clip_high"): "loss.kl_cov_coef (KL-Cov has no ratio clip; its penalty is the constraint)",
    ("aspo", "dual_clip_c"): "loss.aspo_dual_clip_c_pos / loss.aspo_dual_clip_c_neg (ASPO's soft dual clips)",
    ("ctpo", "clip_low"): "loss.ctpo_clip_low (CTPO's log-space base, scaled by t^ctpo_clip_power)",
    ("ctpo", "clip_high"): "loss.ctpo_clip_high (CTPO's log-space base, scaled by t^ctpo_clip_power)",
    ("ctpo", "dual_clip_c"): "loss.ctpo_clip_c (CTPO's log-space dual-clip base)",
}


def _given(loss, key: str) -> bool:
    """Set in the config and different from the schema default (a resolved dump's defaults pass)."""
    return key in loss.model_fields_set and getattr(loss, key) != type(loss).model_fields[key].default


def _reads(loss) -> set[str]:
    reads = set(READS.get(loss.type, ()))
    if loss.type == "cispo" and loss.cispo_clip_high is not None:
        reads.discard("clip_high")  # cispo_clip_high replaces it
    return reads


def ignored_loss_keys(cfg) -> Iterable[str]:
    """One message per ``loss.*`` key the config sets that its loss type / aggregation does not read."""
    loss = cfg.loss
    reads = _reads(loss)
    for key in LOSS_SPECIFIC:
        if key in reads or not _given(loss, key):
            continue
        value = getattr(loss, key)
        if key == "clip_high" and loss.type == "cispo":
            yield (
                f"loss.clip_high={value} is ignored by loss.type='cispo' while loss.cispo_clip_high="
                f"{loss.cispo_clip_high} is set; expected only loss.cispo_clip_high"
            )
            continue
        readers = ", ".join(t for t, keys in READS.items() if key in keys)
        fix = INSTEAD.get((loss.type, key), f"no loss.{key} (only loss.type {readers} read it)")
        yield f"loss.{key}={value} is ignored by loss.type={loss.type!r}; expected {fix}"
    if _given(loss, "norm_len") and loss.aggregation != "seq_mean_token_sum_norm":
        yield (
            f"loss.norm_len={loss.norm_len} is ignored by loss.aggregation={loss.aggregation!r}; expected "
            "loss.aggregation='seq_mean_token_sum_norm' (the only one with a fixed length normaliser) or no norm_len"
        )
