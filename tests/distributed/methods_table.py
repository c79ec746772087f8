"""The methods the rank-equality loop trains: every registered loss and estimator, and the correction masks.

Each method is a name and the dotted overrides that select it on ``configs/tiny_cpu.yaml`` (R3, Keep Sampling
Mask, decoupled, IcePop) at the step-equality shape (``tests.train.records_fixture.SHAPE``). The loss section is
rebuilt from ``loss.type`` alone: tiny_cpu's GSPO clip bounds would be refused by the preflight for a loss that
does not read them. Losses and estimators come from the registries, so a newly registered one joins the loop;
correction masks and loss terms are listed here with thresholds that act on the saved records (the test checks
that each mask removes something). ``method_config`` is shared by the worker and the pytest side.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from moe_rl.algo import adv_estimator_names, policy_loss_names
from moe_rl.config import ExperimentConfig
from moe_rl.config.loader import apply_overrides, load_yaml_tree, validate_tree
from moe_rl.records import RolloutBatch
from tests.train.records_fixture import CONFIG, RECORDS, SHAPE

# every run: one step, the alarm off (it is a guard, not a method: a skipped step would have no update to compare)
BASE = [*SHAPE, "train.steps=1", "correction.kl_alarm=null", "correction.kl_alarm_factor=null"]

# correction masks, IS variants and loss terms beyond the loss type: name -> overrides (on loss.type ppo_clip)
CORRECTIONS: dict[str, tuple[str, ...]] = {
    "corr/none": ("correction.icepop=false",),
    "corr/icepop_token": ("correction.icepop_low=0.9", "correction.icepop_high=1.1"),
    "corr/icepop_unweighted": (
        "correction.icepop_low=0.9",
        "correction.icepop_high=1.1",
        "correction.icepop_weighted=false",
    ),
    "corr/icepop_sequence": (
        "correction.icepop_level=sequence",
        "correction.icepop_low=0.8",
        "correction.icepop_high=1.25",
    ),
    "corr/icepop_geometric": (
        "correction.icepop_level=geometric",
        "correction.icepop_low=0.98",
        "correction.icepop_high=1.02",
    ),
    "corr/tis_token": ("correction.icepop=false", "correction.is_level=token", "correction.is_threshold=1.05"),
    "corr/tis_sequence_batchnorm": (
        "correction.icepop=false",
        "correction.is_level=sequence",
        "correction.is_threshold=1.1",
        "correction.is_batch_normalize=true",
    ),
    "corr/rs_token_k1": ("correction.rs_mode=token_k1", "correction.rs_lower=0.9", "correction.rs_upper=1.1"),
    "corr/rs_seq_mean_k3": ("correction.rs_mode=seq_mean_k3", "correction.rs_upper=0.005"),
    "corr/rejection_chain": (
        "correction.rejection=[{mode: seq_max_k2, upper: 0.02}, {mode: token_k1, lower: 0.8, upper: 1.25}]",
    ),
    "corr/m2po": ("correction.m2po_tau=0.001",),
    "corr/token_veto": ("correction.token_veto_threshold=0.9",),
    "corr/opsm": ("correction.opsm_delta=0.0005",),
    "corr/trm_k3": ("correction.trm_delta=0.02",),
    "corr/trm_k2": ("correction.trm_delta=0.02", "correction.trm_estimator=k2"),
    "corr/max_token_staleness": ("correction.max_token_staleness=0",),  # sync records: runs, masks nothing
    "corr/bypass": ("correction.mode=bypass",),
    "corr/bypass_tis": (  # REINFORCE: in bypass mode the IS weights apply to a loss without a ratio
        "correction.mode=bypass",
        "correction.icepop=false",
        "correction.is_level=token",
        "correction.is_threshold=1.1",
        "loss.type=reinforce",
    ),
    "corr/a3po": ("correction.prox_logp_method=loglinear",),  # trains step 3: A3PO_STEP; IcePop per microbatch
    # the same with M2PO at a budget no token exceeds: a minibatch-wide correction, so π_prox comes from a
    # no-grad pre-pass of each minibatch instead of the update's forward; every other metric must be corr/a3po's
    "corr/a3po_prepass": ("correction.prox_logp_method=loglinear", "correction.m2po_tau=1e6"),
    "corr/bypass_tis_otb": (  # the token baselines' Σπ² pass in bypass mode, beside a bypass correction's pre-pass
        "correction.mode=bypass",
        "correction.icepop=false",
        "correction.is_level=token",
        "correction.is_threshold=1.1",
        "loss.type=reinforce",
        "advantage.estimator=optimal_token_baseline",
    ),
    "optim/ess_lr_scaling": ("optim.ess_lr_scaling=true",),
    "loss/kl_ref": ("loss.kl_coef=0.05", "loss.kl_estimator=k3"),
    "loss/entropy": ("loss.entropy_coef=0.01",),
    "agg/token_sum": ("loss.aggregation=token_sum",),
    "agg/seq_mean_token_sum": ("loss.aggregation=seq_mean_token_sum",),
    "agg/seq_mean_token_sum_norm": ("loss.aggregation=seq_mean_token_sum_norm", "loss.norm_len=12"),
}

# a loss's own overrides: Clip-Cov's defaults select nothing on these records (2e-4 of ~200 tokens); OAPL's
# anchor is the rollout policy π_inf = μ, i.e. bypass mode (moe_rl.algo.oapl_loss)
LOSS_OVERRIDES: dict[str, tuple[str, ...]] = {
    "clip_cov": ("loss.clip_cov_ratio=0.05", "loss.clip_cov_lb=0.0"),
    "oapl": ("correction.mode=bypass",),
}

# per correction: the metric that says it acted (the test wants it strictly between 0 and 1)
ACTS: dict[str, str] = {
    "corr/icepop_token": "icepop/masked_frac",
    "corr/icepop_unweighted": "icepop/masked_frac",
    "corr/icepop_sequence": "icepop/seq_masked_frac",
    "corr/icepop_geometric": "icepop/seq_masked_frac",
    "corr/tis_token": "is/truncated_frac",
    "corr/tis_sequence_batchnorm": "is/truncated_frac",
    "corr/rs_token_k1": "rs/masked_frac",
    "corr/rs_seq_mean_k3": "rs/masked_frac",
    "corr/rejection_chain": "rs/masked_frac",
    "corr/m2po": "m2po/masked_frac",
    "corr/token_veto": "veto/seq_masked_frac",
    "corr/opsm": "opsm/seq_masked_frac",
    "corr/trm_k3": "trm/seq_masked_frac",
    "corr/trm_k2": "trm/seq_masked_frac",
    "corr/bypass_tis": "is/truncated_frac",
    "corr/a3po": "a3po/alpha_mean",
    "optim/ess_lr_scaling": "vcpo/lr_scale",
    "loss/clip_cov": "loss/cov_clip_frac",
    "loss/kl_cov": "loss/cov_kl_frac",
}

# what the preflight refuses on tiny_cpu today (the function exists; the step does not feed it yet)
REFUSED = {}

# A-3PO's interpolation acts on tokens at least two versions old: its method trains the records' step 3 (index 2),
# whose tokens carry versions 0, 1, 2 (``shifted_records``); at weights version 2, alpha = 1/2, 0, 0 on them
A3PO_STEP = 2
STEP_OF: dict[str, int] = {"corr/a3po": A3PO_STEP, "corr/a3po_prepass": A3PO_STEP}


def a3po_token_versions(response_lens: np.ndarray) -> np.ndarray:
    """Token j of an n-token response was generated by version min(2, 3j // n) (a partial rollout over 3 syncs)."""
    return np.concatenate([np.minimum(2, 3 * np.arange(n) // n) for n in response_lens.astype(np.int64)]).astype(
        np.int32
    )


def shifted_records(out: Path, sd: float = 0.1, seed: int = 0) -> Path:
    """The committed records with μ moved by N(0, sd) nats per token (an FP8-sized engine mismatch, both ways),
    and a ReMax ``reward_baselines`` per sample (below).

    The saved bf16 rollouts sit within 3e-3 nats of the fp32 learner, where no mask acts; Keep Sampling Mask's
    μ (``sampling_logp``) moves with the same noise."""
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for f in sorted(RECORDS.glob("step_*.safetensors")):
        batch = RolloutBatch.load(f)
        noise = rng.normal(0.0, sd, size=batch.rollout_logp.shape).astype(np.float32)
        batch.rollout_logp = np.minimum(batch.rollout_logp + noise, 0.0)
        # ReMax's greedy reward per prompt (the saved records predate it): each group's first sample's reward
        # minus 0.25, so the advantages r - b are neither zero nor a group's centring
        first = {int(g): float(r) for g, r in reversed(list(zip(batch.group_ids, batch.rewards)))}
        batch.extra["reward_baselines"] = [first[int(g)] - 0.25 for g in batch.group_ids]
        if batch.sampling_logp is not None:
            batch.sampling_logp = np.minimum(batch.sampling_logp + noise, 0.0)
        batch.save(out / f.name)
    batch = RolloutBatch.load(out / "step_000000.safetensors")  # its samples again as step 3's, over 3 versions
    batch.weight_versions = [f"step-{A3PO_STEP}"] * len(batch)
    batch.token_versions = a3po_token_versions(batch.response_lens)
    batch.save(out / f"step_{A3PO_STEP:06d}.safetensors")
    return out


def methods() -> dict[str, tuple[str, ...]]:
    """Every method of the loop: name -> overrides (loss types, estimators, corrections), in a fixed order."""
    out = {f"loss/{t}": (f"loss.type={t}", *LOSS_OVERRIDES.get(t, ())) for t in policy_loss_names()}
    out |= {f"adv/{e}": (f"advantage.estimator={e}",) for e in adv_estimator_names()}
    return out | CORRECTIONS


def method_config(name: str, records: Path, hf_dir: Path, out: Path, micro_batch_size: int) -> ExperimentConfig:
    """The config of ``name``: tiny_cpu, the loss section reduced to its type, the method's overrides."""
    tree = load_yaml_tree(CONFIG)
    tree["loss"] = {"type": "ppo_clip"}  # tiny_cpu's GSPO clip bounds are read by few losses
    overrides = [
        *BASE,
        f"train.rollouts_from={records}",
        f"checkpoint.init_from_hf={hf_dir}",
        f"train.output_dir={out}",
        f"train.micro_batch_size={micro_batch_size}",
        *methods()[name],
    ]
    return validate_tree(apply_overrides(tree, overrides))
