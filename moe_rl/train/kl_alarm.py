"""``correction.kl_alarm``: a step whose rollout-vs-learner mismatch is far outside its normal range is not trained on.

Owns the alarm's decision for one step and its bookkeeping. The step's ``offpolicy/kl_k3`` (``moe_rl.algo.metrics``:
mean(ρ − log ρ − 1), ρ = π_old / μ over the response tokens) is measured on the whole batch before any update: from
the old-log-prob rows in decoupled mode, from one extra forward pass at the current weights in bypass mode. Above
the threshold (measured normal ranges in docs/operations.md) the step is skipped: its metrics row carries
``alarm/kl_k3`` and ``alarm/skipped = 1`` instead of ``offpolicy/kl_k3``, the log says so in one line, and
``correction.kl_alarm_max_in_row`` skipped steps in a row stop the run (``KLAlarmStop``: one line, exit code 2).
Rollouts from weights the learner does not hold (foreign weights, a half-applied update, another model) look like
this; the served-weights fingerprint (``moe_rl.sync.served_weights``) catches them before, this is the net behind.

Only tokens made by the weights the learner holds count (staleness 0, from the records' ``token_versions``): a
token ``n`` versions old also carries the policy's own ``n`` updates (measured: ``offpolicy/kl_k3`` 1.1e-2 … 1.4e-2
at staleness 1 in the tiny async run, 3e-7 at staleness 0), which the alarm cannot tell from foreign weights. An
async step with no fresh token is not checked (``alarm/unchecked = 1``; the fingerprint still is).

**Adaptive** (``correction.kl_alarm_factor``, ``kl_alarm_window``, ``kl_alarm_warmup``): a step also alarms when its
``offpolicy/kl_k3`` exceeds ``factor`` x the median of the last ``window`` checked steps, once ``warmup`` steps are in
the window. An absolute threshold must sit above every config's normal range (1e-2 by default), while foreign experts
lifted the tiny run's 3e-7 to 7e-4 … 4e-3 (issue 57): 1,000-10,000x its own normal, under the threshold. The median
is over the steps that were trained on: an alarmed step never enters it, so weights that stay foreign cannot raise
the median until they pass as normal (the cost: a real, lasting shift of the mismatch alarms until
``kl_alarm_max_in_row`` stops the run; raise the factor or turn it off). The median is floored at ``MEDIAN_FLOOR``
(a mismatch numerically zero, e.g. identical kernels, would otherwise alarm on rounding). The window starts empty at a
resume. Step numbers in messages are the 1-based steps of metrics.jsonl.

Rank 0 decides and broadcasts the value, so every rank skips (or trains) the same step.
"""

from __future__ import annotations

import logging
import statistics
from collections import deque

import torch

from moe_rl.algo.metrics import offpolicy_metrics
from moe_rl.train.batching import response_row_mask, response_rows

__all__ = ["KLAlarm", "KLAlarmStop"]

logger = logging.getLogger(__name__)

MEDIAN_FLOOR = 1e-8  # the adaptive alarm needs kl_k3 > factor x max(median, this): 1e-6 at the default factor


class KLAlarmStop(RuntimeError):
    """``correction.kl_alarm_max_in_row`` steps in a row were over the alarm; the message says why and what to do."""


class KLAlarm:
    """Per run: ``check(step, kl)`` -> skip this step?; counts skipped steps in a row, keeps the adaptive window."""

    def __init__(
        self,
        threshold: float | None,
        max_in_row: int,
        factor: float | None = None,
        window: int = 20,
        warmup: int = 5,
    ):
        self.threshold, self.max_in_row, self.in_row = threshold, max_in_row, 0
        self.factor = factor if factor and window else None  # None/0 factor or a 0 window: the adaptive alarm is off
        self.warmup = max(1, warmup)
        self.recent: deque[float] = deque(maxlen=max(1, window))  # kl_k3 of the last trained-on steps

    @classmethod
    def from_config(cls, correction) -> KLAlarm:
        c = correction
        return cls(c.kl_alarm, c.kl_alarm_max_in_row, c.kl_alarm_factor, c.kl_alarm_window, c.kl_alarm_warmup)

    @property
    def enabled(self) -> bool:
        return self.threshold is not None or self.factor is not None

    def median(self) -> float | None:
        """The running median the adaptive alarm compares with (None: off, or still warming up)."""
        if self.factor is None or len(self.recent) < self.warmup:
            return None
        return statistics.median(self.recent)

    def why(self, kl: float) -> str | None:
        """Why ``kl`` alarms (both figures named), or None."""
        reasons = []
        if self.threshold is not None and kl > self.threshold:
            reasons.append(f"> correction.kl_alarm={self.threshold:g}")
        if (median := self.median()) is not None and kl > self.factor * max(median, MEDIAN_FLOOR):
            reasons.append(
                f"= {kl / max(median, MEDIAN_FLOOR):.3g}x its running median {median:.3g} over the last "
                f"{len(self.recent)} steps (> correction.kl_alarm_factor={self.factor:g})"
            )
        return " and ".join(reasons) or None

    @staticmethod
    def batch_kl_k3(
        batch, rows: torch.Tensor, width: int, kept_logp: bool, staleness: torch.Tensor | None = None
    ) -> float | None:
        """``offpolicy/kl_k3`` of the batch's fresh tokens: ``rows[N, R]`` (π_old) against the rollout log-probs,
        over the response tokens whose ``staleness[N, R]`` is 0 (all of them when None); None when there is no such
        token. Rank 0's value on every rank."""
        ids = list(range(len(batch)))
        mu = response_rows(batch, ids, width, kept_logp=kept_logp).to(rows.device)
        mask = response_row_mask(batch, ids, width).to(rows.device)
        if staleness is not None:
            mask = mask & (staleness.to(rows.device) == 0)
        value = [float(offpolicy_metrics(rows.float(), mu.float(), mask)["offpolicy/kl_k3"]) if mask.any() else None]
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.broadcast_object_list(value, src=0)  # size: one float; gloo or NCCL alike
        return value[0]

    def verdict(
        self, step: int, batch, rows: torch.Tensor, width: int, kept_logp: bool, staleness: torch.Tensor | None
    ) -> tuple[bool, dict[str, float]]:
        """(skip this step?, its row's ``alarm/*`` metrics): ``batch_kl_k3`` then ``check``."""
        kl = self.batch_kl_k3(batch, rows, width, kept_logp, staleness)
        if kl is None:  # async, every token stale: its KL holds the policy's own updates (module docstring)
            return False, {"alarm/unchecked": 1.0}
        if self.check(step, kl):
            return True, {"alarm/kl_k3": kl, "alarm/skipped": 1.0}
        return False, {}

    def check(self, step: int, kl: float) -> bool:
        """True: do not train on ``step`` (the 1-based step of metrics.jsonl; logged once); KLAlarmStop after
        ``max_in_row`` such steps in a row. A step that does not alarm enters the adaptive window."""
        why = self.why(kl)
        if why is None:
            self.in_row = 0
            self.recent.append(kl)
            return False
        self.in_row += 1
        if self.in_row >= self.max_in_row:
            raise KLAlarmStop(
                f"step {step}: offpolicy/kl_k3={kl:.3g} {why}, {self.in_row} step{'s' * (self.in_row != 1)} in a row "
                f"(correction.kl_alarm_max_in_row={self.max_in_row}): the rollouts do "
                "not come from the weights the learner holds (foreign or half-applied weights, another model, a "
                "rollout dtype or kernel change); stopping. Check the server and its weights, then resume"
            )
        logger.warning(
            "kl alarm: step %d not trained on: offpolicy/kl_k3=%.3g %s (%d in a row, stop at %d)",
            step,
            kl,
            why,
            self.in_row,
            self.max_in_row,
        )
        return True
