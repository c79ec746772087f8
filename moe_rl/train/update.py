"""The learner side of one RL step, executing a ``StepPlan``: the old-log-prob pass and the updates.

Owns the order of passes per minibatch and the step-global statistics (issue: "the same answer
as one rank"): every quantity that couples samples — rejection, IS batch normalisation, the
loss denominator, every logged metric — is computed on response rows ``[N_mb, R]`` of the
whole minibatch, gathered from all data-parallel ranks, in three phases:

1. ``prepare_corrections`` on π_old (decoupled) or on π_θ from a no-grad pre-pass (bypass with
   corrections: the weights do not change within a minibatch, so the pre-pass sees the π_θ the
   update will). Nothing here depends on micro_batch_size or dp size;
2. each microbatch's loss (its tokens' sum over the step-global denominator), backward,
   Megatron's gradient finalisation, one optimizer step;
3. ``policy_loss`` once more on the gathered detached π_θ rows: exact minibatch metrics, and
   the minibatch loss (the sum of the microbatch losses).
Step inputs beyond the log-probs: Σ_v π_v² per token from the old-log-prob pass when the estimator
reads it (``needs_sum_pi_squared``: the optimal token baselines, VCPO's exact gradient norm), and under
``correction.prox_logp_method: loglinear`` (A-3PO) no old-log-prob pass: π_prox is interpolated between μ and
sg[π_θ] by each token's weight version, inside each microbatch's loss from the update's own forward (AReaL's
place: no extra forward), or, when a minibatch-wide correction reads π_prox before the update
(``a3po_needs_prepass``), from the minibatch's no-grad pre-pass.
Megatron's aux / z losses are per-microbatch means by design: the one exception to
microbatch invariance (docs/training.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from moe_rl.algo import compute_advantages, needs_policy_prepass, policy_loss, prepare_corrections
from moe_rl.algo.advantages import logit_grad_sq_norm
from moe_rl.algo.proximal import a3po_needs_prepass, a3po_proximal_logp
from moe_rl.algo.tensors import masked_sum
from moe_rl.algo.variance_control import ess_lr_scale
from moe_rl.learner.pipeline import from_last_stage, is_last_stage, object_from_last_stage
from moe_rl.records import RolloutBatch
from moe_rl.train.batching import Microbatch, build_microbatch, response_row_mask, response_rows
from moe_rl.train.collectives import all_gather_rows, dp_group
from moe_rl.train.logprob import make_logprob_fn
from moe_rl.train.plan import MinibatchPlan, StepPlan
from moe_rl.train.staleness import staleness_kl_metrics

__all__ = [
    "MinibatchResult",
    "StepInputs",
    "needs_sum_pi_squared",
    "old_logprob_rows",
    "reference_rows",
    "runs_old_logprob_pass",
    "step_advantages",
    "update_minibatch",
]

TOKEN_BASELINES = ("optimal_token_baseline", "tir_optimal_token_baseline")


@dataclass
class StepInputs:
    """What every pass of one step reads: the records, per-sample advantages and the row width."""

    batch: RolloutBatch
    advantages: torch.Tensor  # [N] float32 per sample, or [N, R] per response token (the token baselines)
    width: int  # R: the longest response of the step; every response-row tensor is [*, R]
    device: torch.device
    step: int = 0
    seed: int = 0
    trainable: torch.Tensor | None = None  # [N] bool: samples that enter the loss (train.mask_truncated); None = all
    token_keep: torch.Tensor | None = None  # [N, R] bool: tokens that may enter the loss (staleness rules); None = all
    staleness: torch.Tensor | None = None  # [N, R] int64: step - token version (per-staleness KL metrics)


@dataclass
class MinibatchResult:
    loss: float
    grad_norm: float
    lr: float
    metrics: dict[str, float]


def runs_old_logprob_pass(cfg) -> bool:
    """Whether π_old comes from the step's old-log-prob pass: decoupled mode, not A-3PO's interpolation."""
    return cfg.correction.mode == "decoupled" and cfg.correction.prox_logp_method == "recompute"


def needs_sum_pi_squared(cfg) -> bool:
    """Whether the step computes Σ_v π_v² per token in an old-log-prob pass: the optimal token baselines
    always (the pass runs for them in bypass / A-3PO too), ``vcpo_opob`` when the pass runs anyway (its
    ‖∇_z log π‖² is then exact; without the pass it keeps the lower bound on μ)."""
    est = cfg.advantage.estimator
    return est in TOKEN_BASELINES or (est == "vcpo_opob" and runs_old_logprob_pass(cfg))


def _microbatches(cfg, inputs: StepInputs, id_groups) -> list[Microbatch]:
    ksm = cfg.ksm_active
    return [
        build_microbatch(
            inputs.batch,
            ids,
            inputs.advantages,
            num_experts=cfg.model.num_moe_experts,
            kept_logp=ksm,
            with_kept_sets=ksm,
            device=inputs.device,
        )
        for ids in id_groups
    ]


def _rows_by_sample(plan_ids_per_rank, gathered: torch.Tensor, num_samples: int) -> torch.Tensor:
    """Gathered rows (rank-major, each rank's ids in ``plan_ids_per_rank[r]``) -> ``[N, R]`` by sample id."""
    out = torch.zeros(num_samples, gathered.shape[1], dtype=gathered.dtype, device=gathered.device)
    order = torch.tensor([i for ids in plan_ids_per_rank for i in ids], dtype=torch.long, device=gathered.device)
    out[order] = gathered
    return out


@torch.no_grad()
def _forward_rows(learner, logprob_fn, mbs: list[Microbatch], temperature: float, width: int) -> torch.Tensor:
    """No-grad forwards of ``mbs`` -> this rank's log-prob rows ``[n, width]`` in microbatch order."""
    logps = learner.forward_logprobs([mb.tensors for mb in mbs], logprob_fn, temperature)
    return torch.cat([mb.to_rows(logp.float(), width) for mb, logp in zip(mbs, logps)])


@torch.no_grad()
def _forward_rows_spp(cfg, learner, mbs: list[Microbatch], width: int) -> torch.Tensor:
    """No-grad forwards of ``mbs`` -> rows ``[2, n, width]``: log-probs and Σ_v π_v² (full or kept-set softmax)."""
    fn = make_logprob_fn(cfg.ksm_active, with_entropy=False, sum_pi_squared=True)
    pairs = learner.forward_logprobs([mb.tensors for mb in mbs], fn, cfg.rollout.temperature, both=True)
    logp = torch.cat([mb.to_rows(lp.float(), width) for mb, (lp, _) in zip(mbs, pairs)])
    spp = torch.cat([mb.to_rows(sq.float(), width) for mb, (_, sq) in zip(mbs, pairs)])
    return torch.stack([logp, spp])


def old_logprob_rows(
    cfg, learner, driver, logprob_fn, plan: StepPlan, inputs: StepInputs, sum_pi_squared: bool = False
):
    """π_old of every sample of the step as rows ``[N, R]``, identical on every data-parallel rank.

    Each rank scores exactly the samples it will update on (``plan.owned_microbatches``) under
    the driver's old-log-prob routing (R3 replays the rollout's routes, R2 records the
    learner's own); the rows are then all-gathered. ``sum_pi_squared``: ``(π_old rows, Σ_v π_v² rows)``
    from the same forwards (the trainer's softmax: full vocabulary, or the kept set under Keep Sampling
    Mask; summed over the tp shards before the dp gather).
    """
    mbs = _microbatches(cfg, inputs, plan.owned_microbatches)
    learner.model.eval()
    with driver.old_logprob_pass([m.routes for m in mbs]):
        if sum_pi_squared:
            local = _forward_rows_spp(cfg, learner, mbs, inputs.width)
        else:
            local = _forward_rows(learner, logprob_fn, mbs, cfg.rollout.temperature, inputs.width)
    per_rank = [[i for mb in plan.minibatches for i in mb.shares[r]] for r in range(plan.dp_size)]
    if sum_pi_squared:
        gathered = all_gather_rows(torch.cat([local[0], local[1]], dim=1), dp_group())  # one gather: [n, 2R]
        rows = _rows_by_sample(per_rank, gathered, len(inputs.batch))
        return rows[:, : inputs.width], rows[:, inputs.width :]
    gathered = all_gather_rows(local, dp_group())
    return _rows_by_sample(per_rank, gathered, len(inputs.batch))


@torch.no_grad()
def reference_rows(cfg, reference, driver, logprob_fn, plan: StepPlan, inputs: StepInputs) -> torch.Tensor:
    """π_ref of every sample as rows ``[N, R]`` (for ``loss.kl_coef > 0``), identical on every rank.

    Routed like π_old: the rollout's routes under R3, the old-log-prob pass's recorded routes
    under R2 (so run this after it), natural routing otherwise; Keep Sampling Mask as the learner.
    """
    mbs = _microbatches(cfg, inputs, plan.owned_microbatches)
    rows = []
    with reference.on_device():  # an offloaded π_ref moves to the device once per pass, not per microbatch
        for m in mbs:
            routes, local = None, False
            if driver.mode == "r3":
                routes = m.routes.rollout
            elif driver.mode == "r2":
                routes, local = driver.r2_routes(m.routes), True
            logp = reference.logprobs(m.tensors, cfg.rollout.temperature, logprob_fn, routes=routes, local_routes=local)
            rows.append(m.to_rows(logp.float(), inputs.width))
    gathered = all_gather_rows(torch.cat(rows), dp_group())
    per_rank = [[i for mb in plan.minibatches for i in mb.shares[r]] for r in range(plan.dp_size)]
    return _rows_by_sample(per_rank, gathered, len(inputs.batch))


def _generator(inputs: StepInputs, mb_plan: MinibatchPlan, epoch: int) -> torch.Generator:
    """Seeded from (train.seed, step, epoch, minibatch): every rank draws the same (it sees the same rows)."""

    seed = int(np.random.SeedSequence([inputs.seed, inputs.step, epoch, mb_plan.index]).generate_state(1)[0])
    return torch.Generator().manual_seed(seed)


def _rows_from_last_stage(logp: list, entropy: list, n: int, width: int, dev):
    """The π_θ (and entropy) rows ``[n, width]`` the loss saw; only the last pipeline stage computed them."""
    has_entropy = object_from_last_stage(bool(entropy))
    last = is_last_stage()
    logp_rows = from_last_stage(torch.cat(logp) if last else None, (n, width), torch.float32, dev)
    if not has_entropy:
        return logp_rows, None
    return logp_rows, from_last_stage(torch.cat(entropy) if last else None, (n, width), torch.float32, dev)


def update_minibatch(
    cfg,
    learner,
    driver,
    logprob_fn,
    mb_plan: MinibatchPlan,
    inputs: StepInputs,
    old_rows: torch.Tensor | None,
    ref_rows: torch.Tensor | None = None,
    epoch: int = 0,
) -> MinibatchResult:
    """One optimizer step on ``mb_plan`` (see the module docstring for the three phases)."""
    dev, width = inputs.device, inputs.width
    ids = list(mb_plan.sample_ids)
    ksm = cfg.ksm_active
    mask = response_row_mask(inputs.batch, ids, width).to(dev)
    # train.mask_truncated, stale samples / tokens: never in the loss (nor its denominator)
    loss_mask = None if inputs.trainable is None else mask & inputs.trainable[ids][:, None].to(dev)
    if inputs.token_keep is not None:
        loss_mask = (mask if loss_mask is None else loss_mask) & inputs.token_keep[ids].to(dev)
    mu = response_rows(inputs.batch, ids, width, kept_logp=ksm).to(dev)
    adv = inputs.advantages[ids].to(dev)
    old = None if old_rows is None else old_rows[ids].to(dev)
    ref = None if ref_rows is None else ref_rows[ids].to(dev)
    mbs = _microbatches(cfg, inputs, mb_plan.microbatches)
    routes = [m.routes for m in mbs]
    group = dp_group()

    # phase 1: step-global corrections over the whole minibatch
    policy, a3po = None, {}
    loglinear = cfg.correction.prox_logp_method == "loglinear"
    prepass = needs_policy_prepass(cfg.correction, cfg.loss, cfg.optim)  # bypass corrections / ESS, Cov: π_θ
    prepass = prepass or (loglinear and a3po_needs_prepass(cfg.correction, cfg.loss, cfg.optim))
    deferred = loglinear and not prepass  # A-3PO's π_prox from the update's forward, per microbatch
    if prepass:
        learner.model.train()
        with driver.prepass(routes):
            policy = all_gather_rows(_forward_rows(learner, logprob_fn, mbs, cfg.rollout.temperature, width), group)
    stale = torch.zeros_like(mask, dtype=torch.int64) if inputs.staleness is None else inputs.staleness[ids].to(dev)
    versions = inputs.step - stale  # A-3PO: each token's weight version v_μ

    def prox(rows, logp_rows):  # A-3PO: π_prox between μ and π_θ, by each token's version
        return a3po_proximal_logp(mu[rows], logp_rows, mask[rows], versions[rows], inputs.step)

    if loglinear and prepass:
        old, a3po = prox(slice(None), policy)
    # deferred: no π_prox yet; no correction here reads it (a3po_needs_prepass), so keep and the denominator are
    # those of μ; the weights and metrics of μ are replaced after the update (phase 3)
    source = old if old is not None else (policy if policy is not None else mu)  # plain bypass: nothing reads it
    norm_len = getattr(cfg.loss, "norm_len", None) or cfg.rollout.max_new_tokens
    generator = _generator(inputs, mb_plan, epoch)

    def prepare(src, rows=slice(None)):
        lm = None if loss_mask is None else loss_mask[rows]
        return prepare_corrections(
            cfg.loss, cfg.correction, src, mu[rows], mask[rows], norm_len=norm_len, policy_logp=policy,
            advantages=adv[rows], generator=generator, loss_mask=lm,
        )  # fmt: skip

    prep = prepare(source)
    lr_scale, vcpo = 1.0, {}
    if getattr(cfg.optim, "ess_lr_scaling", False):
        scale, vcpo = ess_lr_scale(masked_sum(source - mu, mask, dim=1), mask.any(dim=1), cfg.optim.ess_lr_min_scale)
        lr_scale = float(scale)

    # phase 2: per-microbatch losses with the global denominator; gradients summed over ranks
    row_of = {sid: k for k, sid in enumerate(ids)}
    seen_logp, seen_entropy = [], []

    def loss_fn(logp, entropy, t):
        m = t["microbatch"]
        rows = torch.tensor([row_of[s] for s in m.sample_ids], dtype=torch.long, device=dev)
        keep = m.from_rows(prep.keep[rows]) & t["mask"]
        weights = None if prep.weights is None else m.from_rows(prep.weights[rows])
        old_t = None if old is None else m.from_rows(old[rows])
        if deferred:  # π_prox of these rows from this forward; their per-token/-sequence IS weights from it
            old_rows, _ = prox(rows, m.to_rows(logp.detach().float(), width))
            local = prepare(old_rows, rows).weights
            old_t, weights = m.from_rows(old_rows), None if local is None else m.from_rows(local)
        ref_t = None if ref is None else m.from_rows(ref[rows])
        cov = None if prep.cov_selected is None else m.from_rows(prep.cov_selected[rows])
        loss, _ = policy_loss(
            cfg.loss,
            cfg.correction,
            logp,
            old_t,
            t["rollout_logp"],
            t["advantages"],
            t["mask"],
            keep,
            weights,
            prep.denominator,
            entropy=entropy,
            ref_logp=ref_t,
            cov_selected=cov,
            generator=generator,
        )
        seen_logp.append(m.to_rows(logp.detach().float(), width))
        if entropy is not None:
            seen_entropy.append(m.to_rows(entropy.detach().float(), width))
        return loss, {}

    for m in mbs:
        m.tensors["microbatch"] = m
    dp_size = 1 if group is None else torch.distributed.get_world_size(group)
    with driver.update_pass(routes):
        stats = learner.train_step(
            [m.tensors for m in mbs],
            loss_fn,
            cfg.rollout.temperature,
            logprob_fn,
            loss_scale=dp_size,
            lr_scale=lr_scale,
        )

    # phase 3: exact minibatch metrics from the gathered detached π_θ (pp > 1: the last stage's rows)
    n_rows = sum(len(m.sample_ids) for m in mbs)
    seen_logp, seen_entropy = _rows_from_last_stage(seen_logp, seen_entropy, n_rows, width, dev)
    logp_rows = all_gather_rows(seen_logp, group)
    ent_rows = all_gather_rows(seen_entropy, group) if seen_entropy is not None else None
    if deferred:  # the π_prox rows every microbatch used, and the corrections' weights and metrics on them
        old, a3po = prox(slice(None), logp_rows)
        source, prep = old, prepare(old)
    _, metrics = policy_loss(
        cfg.loss,
        cfg.correction,
        logp_rows,
        old,
        mu,
        adv,
        mask,
        prep.keep,
        prep.weights,
        prep.denominator,
        entropy=ent_rows,
        ref_logp=ref,
        cov_selected=prep.cov_selected,
        generator=_generator(inputs, mb_plan, epoch),
    )
    metrics = {k: float(v) for k, v in (prep.metrics | vcpo | a3po | metrics).items()}
    if inputs.staleness is not None and source is not mu:  # bypass without a pre-pass has no π to compare
        metrics |= staleness_kl_metrics(source, mu, mask, inputs.staleness[ids].to(dev))
    return MinibatchResult(metrics["loss/total"], stats.grad_norm, stats.lr, metrics)


def step_advantages(
    cfg,
    batch: RolloutBatch,
    rewards: torch.Tensor,
    old: torch.Tensor | None,
    width: int,
    sum_pi_squared: torch.Tensor | None = None,
):
    """Per-sample advantages ``[N]`` of a step, or ``[N, R]`` rows for the optimal token baselines.

    VCPO's baseline reads π_old (or μ in bypass mode), and Σ_v π_v² rows when given (its gradient norm is
    then exact); the token baselines read π_old and Σ_v π_v² rows of the old-log-prob pass.
    """

    ids = list(range(len(batch)))
    extra = {"lengths": torch.as_tensor(batch.response_lens.astype("int64"), device="cpu")}
    est = cfg.advantage.estimator
    if est == "vcpo_opob":
        mask = response_row_mask(batch, ids, width)
        mu = response_rows(batch, ids, width, kept_logp=cfg.ksm_active)
        src = mu if old is None else old.cpu()
        spp = None if (sum_pi_squared is None or old is None) else sum_pi_squared.cpu().double()
        extra["is_weights"] = torch.exp(((src - mu) * mask).sum(1).clamp(-20, 20)).double()
        extra["grad_sq_norms"] = logit_grad_sq_norm(src, mask, sum_p_sq=spp).double()
    if est == "remax":  # the greedy response's reward per sample (records' reward_baselines)
        extra["reward_baselines"] = torch.from_numpy(batch.reward_baselines()).to("cpu").double()
    if est in TOKEN_BASELINES:
        if old is None or sum_pi_squared is None:
            raise ValueError(f"advantage.estimator={est!r} needs π_old and Σ_v π_v² rows from the old-log-prob pass")
        extra |= {
            "mask": response_row_mask(batch, ids, width),
            "old_logp": old.cpu().double(),
            "sum_pi_squared": sum_pi_squared.cpu().double(),
        }
    return compute_advantages(cfg.advantage, rewards, cfg.rollout.samples_per_prompt, **extra).float()
