"""The registries of policy losses and advantage estimators, picked by ``loss.type`` / ``advantage.estimator``.

Owns the inputs every loss reads (:class:`LossInputs`: the per-token tensors, IS weights, aggregation and
denominator), their validation, the finishing step every loss shares (IS weights times the per-token term,
aggregation, ``loss/pg_loss``), the hyper-parameter model base (:class:`LossParams`: its fields are the
``loss.*`` keys the loss reads), and the name -> function tables. Adding a loss is one function plus its
hyper-parameter model, registered by name (docs/algo.md, "Adding a loss or an advantage estimator")::

    @dataclass(frozen=True)
    class MyParams(LossParams):
        clip_high: float = 0.2

    @register_policy_loss("my_loss", MyParams)
    def my_loss(x: LossInputs, p: MyParams) -> tuple[torch.Tensor, Metrics]:
        return per_token_loss, metrics  # per_token_loss[B, T]; the registry multiplies IS weights and aggregates

The verbs are verl's (``register_policy_loss`` / ``get_policy_loss_fn``, ``register_adv_est`` /
``get_adv_estimator_fn``). A loss or estimator is registered when its module is imported; ``moe_rl.algo``
imports every one, so importing anything from the package fills the tables. The config keeps its own list
of names (``moe_rl.config`` does not import ``moe_rl.algo``); tests/algo/test_registry.py checks both agree.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any, Protocol

import torch

from moe_rl.algo.aggregation import aggregate
from moe_rl.algo.tensors import Metrics, check_logp, check_mask, check_seq_or_token, metric


class LossConfigLike(Protocol):
    """Attributes read from the config's ``loss`` section (moe_rl.config.LossConfig).

    Optional (schema defaults when absent): the per-loss fields of each loss's hyper-parameter model
    (``cispo_clip_low``, ``sapo_tau_pos``, ...), ``norm_len`` (None) and ``scale_factor`` (1.0).
    """

    type: str
    clip_low: float
    clip_high: float
    dual_clip_c: float | None
    aggregation: str
    kl_coef: float
    kl_estimator: str
    entropy_coef: float


@dataclass(frozen=True)
class LossInputs:
    """What a policy loss reads besides its hyper-parameters, on ``[B, T]`` tensors.

    ``logp`` is π_θ (carries the gradient); ``old_logp`` the trust-region anchor (π_old, or μ in bypass
    mode; None for a loss that reads no ratio); ``advantages`` ``[B]`` or ``[B, T]``; ``mask`` the final
    loss mask (after rejection; all False gives a graph-connected zero loss and finite metrics);
    ``is_weights`` optional detached per-token importance weights that multiply each token's term before
    aggregation (seed 001, "TIS × Multi-Epoch": r_TIS · min(r·A, clip(r)·A)); ``aggregation`` (None =
    the loss's own default) and ``loss_denominator`` (None = this batch's divisor) as in ``aggregate``;
    ``generator`` and ``selected[B, T]`` are for losses that select tokens (Clip-Cov's seeded draw, or
    the minibatch's phase-1 selection that replaces it).
    """

    logp: torch.Tensor
    old_logp: torch.Tensor | None
    advantages: torch.Tensor
    mask: torch.Tensor
    is_weights: torch.Tensor | None = None
    aggregation: str | None = None
    loss_denominator: float | None = None
    generator: torch.Generator | None = None
    selected: torch.Tensor | None = None

    def checked(self) -> LossInputs:
        """Validated copy: bool mask, float log-probs (half precision upcast), advantages as ``[B, T]``.

        ``old_logp``, ``advantages`` and ``is_weights`` are detached; IS weights must be non-negative.
        """
        mask = check_mask(self.mask, allow_empty=True)  # nothing kept: every loss is a graph-connected zero
        logp = check_logp("logp", self.logp, mask)
        old = None if self.old_logp is None else check_logp("old_logp", self.old_logp.detach(), mask)
        adv = check_seq_or_token("advantages", self.advantages.detach(), mask)
        w = self.is_weights
        if w is not None:
            w = check_logp("is_weights", w.detach(), mask)
            if bool((w < 0).any()):
                raise ValueError("is_weights: expected non-negative importance weights, got a negative value")
        return replace(self, logp=logp, old_logp=old, advantages=adv, mask=mask, is_weights=w)

    def finish(
        self, per_token: torch.Tensor, metrics: Metrics, aggregation: str, weigh: bool = True
    ) -> tuple[torch.Tensor, Metrics]:
        """IS weights times ``per_token[B, T]`` (unless ``weigh`` is False), aggregated over the mask; adds ``loss/pg_loss``."""
        if weigh and self.is_weights is not None:
            per_token = per_token * self.is_weights
        agg = aggregation if self.aggregation is None else self.aggregation
        loss = aggregate(per_token, self.mask, agg, denominator=self.loss_denominator)
        metrics["loss/pg_loss"] = metric(loss)
        return loss, metrics


@dataclass(frozen=True)
class LossParams:
    """Base of a loss's hyper-parameter model: each field is the ``loss.*`` key of that name.

    Field defaults are the loss's own defaults when called directly; from a config the values are the
    config's (``from_config``). A field in ``LossConfigLike`` must be present on a duck-typed config;
    any other missing field takes the model's default (the schema's).
    """

    @classmethod
    def from_config(cls, loss_cfg: LossConfigLike) -> LossParams:
        required = LossConfigLike.__annotations__
        values = {
            f.name: getattr(loss_cfg, f.name) if f.name in required else getattr(loss_cfg, f.name, f.default)
            for f in fields(cls)
        }
        return cls(**values)


LossFn = Callable[[LossInputs, Any], tuple[torch.Tensor, Metrics]]
SelectFn = Callable[[LossInputs, Any], torch.Tensor]


class PolicyLoss:
    """A registered loss: call it as ``loss(x: LossInputs, params=None) -> (scalar loss to minimise, metrics)``.

    ``fn(x, params)`` gives the per-token term and metrics on validated inputs; the call adds IS weights
    and aggregation (``LossInputs.finish``). ``aggregation`` is the default when ``x.aggregation`` is
    None; ``anchored`` says the loss is a ratio to ``old_logp`` (in bypass mode π_θ/μ already is the
    IS correction, so IS weights are not multiplied into it again); ``select(x, params) -> [B, T]``,
    when given, is the loss's token selection, computed once over a minibatch on the no-grad π_θ
    (``prepare_corrections``) and passed back as ``x.selected``; ``folds_is_weights`` says the loss
    reads ``x.is_weights`` itself (VESPO folds them into its sequence ratio), so they are not multiplied again.
    """

    def __init__(
        self,
        name: str,
        fn: LossFn,
        params: type[LossParams],
        aggregation: str,
        anchored: bool,
        select: SelectFn | None,
        folds_is_weights: bool = False,
    ) -> None:
        self.name, self.fn, self.params = name, fn, params
        self.aggregation, self.anchored, self.select = aggregation, anchored, select
        self.folds_is_weights = folds_is_weights
        functools.update_wrapper(self, fn)

    def __call__(self, x: LossInputs, params: LossParams | None = None) -> tuple[torch.Tensor, Metrics]:
        x = x.checked()
        if self.anchored and x.old_logp is None:
            raise ValueError(
                f"old_logp: loss {self.name!r} is a ratio to the anchor; expected log-probs [B, T], got None"
            )
        per_token, metrics = self.fn(x, self.params() if params is None else params)
        return x.finish(per_token, metrics, self.aggregation, weigh=not self.folds_is_weights)

    def __repr__(self) -> str:
        return f"PolicyLoss({self.name!r})"


_POLICY_LOSSES: dict[str, PolicyLoss] = {}


def register_policy_loss(
    name: str,
    params: type[LossParams],
    *,
    aggregation: str = "token_mean",
    anchored: bool = True,
    select: SelectFn | None = None,
    folds_is_weights: bool = False,
) -> Callable[[LossFn], PolicyLoss]:
    """Decorator: register ``fn(x: LossInputs, p: params) -> (per_token[B, T], metrics)`` as ``loss.type`` ``name``.

    Returns the :class:`PolicyLoss` (callable, returns the aggregated loss). See :class:`PolicyLoss` for
    ``aggregation``, ``anchored``, ``select`` and ``folds_is_weights``.
    """

    def register(fn: LossFn) -> PolicyLoss:
        if name in _POLICY_LOSSES:
            raise ValueError(f"loss.type {name!r}: already registered by {_POLICY_LOSSES[name].fn.__qualname__}")
        loss = PolicyLoss(name, fn, params, aggregation, anchored, select, folds_is_weights)
        _POLICY_LOSSES[name] = loss
        return loss

    return register


def policy_loss_names() -> tuple[str, ...]:
    """Every registered ``loss.type``, in registration order."""
    return tuple(_POLICY_LOSSES)


def get_policy_loss_fn(name: str) -> PolicyLoss:
    """The loss registered as ``name`` (ValueError naming the registered ones otherwise)."""
    try:
        return _POLICY_LOSSES[name]
    except KeyError:
        raise ValueError(f"loss.type: expected one of {policy_loss_names()}, got {name!r}") from None


register_loss = register_policy_loss
get_loss = get_policy_loss_fn


def surrogate_loss(loss_cfg: LossConfigLike, x: LossInputs) -> tuple[torch.Tensor, Metrics]:
    """The policy-gradient loss ``loss_cfg.type`` with the config's hyper-parameters on ``x``.

    ``x.aggregation`` None takes ``loss_cfg.aggregation``. Optional config fields missing from a
    duck-typed ``loss_cfg`` take the schema defaults.
    """
    loss = get_policy_loss_fn(loss_cfg.type)
    if x.aggregation is None:
        x = replace(x, aggregation=loss_cfg.aggregation)
    return loss(x, loss.params.from_config(loss_cfg))


@dataclass(frozen=True)
class AdvantageInputs:
    """What an advantage estimator reads: ``rewards[B]`` and the groups (``group_size`` contiguous, or
    ``group_ids[B]``), with ``lengths[B]`` (response token counts), ``is_weights[B]`` (sequence IS
    weights) and ``grad_sq_norms[B]`` for the estimators that use them; ``reward_baselines[B]`` (ReMax:
    the greedy sample's reward), ``reward_components[B, K]`` (GDPO: one column per reward), and the
    token tensors of the optimal token baselines — ``mask[B, T]``, ``old_logp[B, T]`` (π_old),
    ``sum_pi_squared[B, T]`` (Σ_v π_v² of π_old's softmax) and ``token_is_weights[B, T]`` (verl's
    ``rollout_is_weights``)."""

    rewards: torch.Tensor
    group_size: int | None = None
    group_ids: torch.Tensor | None = None
    lengths: torch.Tensor | None = None
    is_weights: torch.Tensor | None = None
    grad_sq_norms: torch.Tensor | None = None
    reward_baselines: torch.Tensor | None = None
    reward_components: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    old_logp: torch.Tensor | None = None
    sum_pi_squared: torch.Tensor | None = None
    token_is_weights: torch.Tensor | None = None


AdvEstimatorFn = Callable[[AdvantageInputs, Any], torch.Tensor]
_ADV_ESTIMATORS: dict[str, AdvEstimatorFn] = {}


def register_adv_est(name: str) -> Callable[[AdvEstimatorFn], AdvEstimatorFn]:
    """Decorator: register ``fn(x: AdvantageInputs, adv_cfg) -> adv`` as ``advantage.estimator`` ``name``.

    ``adv`` is ``[B]`` (one value per response) or, for a per-token baseline, ``[B, T]`` on ``x.mask``.

    ``adv_cfg`` is the config's ``advantage`` section (its hyper-parameters, e.g. ``eps``).
    """

    def register(fn: AdvEstimatorFn) -> AdvEstimatorFn:
        if name in _ADV_ESTIMATORS:
            raise ValueError(
                f"advantage.estimator {name!r}: already registered by {_ADV_ESTIMATORS[name].__qualname__}"
            )
        _ADV_ESTIMATORS[name] = fn
        return fn

    return register


def adv_estimator_names() -> tuple[str, ...]:
    """Every registered ``advantage.estimator``, in registration order."""
    return tuple(_ADV_ESTIMATORS)


def get_adv_estimator_fn(name: str) -> AdvEstimatorFn:
    """The estimator registered as ``name`` (ValueError naming the registered ones otherwise)."""
    try:
        return _ADV_ESTIMATORS[name]
    except KeyError:
        raise ValueError(f"advantage.estimator: expected one of {adv_estimator_names()}, got {name!r}") from None


get_adv_estimator = get_adv_estimator_fn
