"""Preflight rule: ``correction.*`` settings the training step cannot run as configured, and losses that are
defined against one correction mode only.

Owns the list of such settings and the message naming what is missing: ``correction.prox_logp_method:
loglinear`` (A-3PO, ``moe_rl.algo.proximal.a3po_proximal_logp``: the step skips the old-log-prob pass and
interpolates π_prox) replaces decoupled mode's π_old, so it needs ``correction.mode: decoupled`` and cannot
run with R2 (which records its routes in the skipped pass); ``loss.type:
oapl`` regresses the log-ratio to the rollout policy π_inf (seed 000, OAPL), which is the ratio's anchor only in
``correction.mode: bypass`` (decoupled mode would silently regress to π_old).
"""

from __future__ import annotations

from collections.abc import Iterable


def correction_settings(cfg) -> Iterable[str]:
    """One message per correction setting a run cannot use."""
    if cfg.correction.prox_logp_method == "loglinear":
        if cfg.correction.mode != "decoupled":
            yield (
                f"correction.prox_logp_method='loglinear' (A-3PO) approximates decoupled mode's proximal anchor "
                f"pi_old; correction.mode={cfg.correction.mode!r} has none: expected correction.mode=decoupled "
                "or correction.prox_logp_method=recompute"
            )
        if cfg.replay.routing == "r2":
            yield (
                "correction.prox_logp_method='loglinear' (A-3PO) skips the old-log-prob pass, where "
                "replay.routing='r2' records the routes it replays: expected replay.routing in {'none', 'r3'} "
                "or correction.prox_logp_method=recompute"
            )
    if cfg.loss.type == "oapl" and cfg.correction.mode != "bypass":
        yield (
            f"loss.type='oapl' regresses log(pi/pi_inf) with pi_inf the rollout policy, which the loss's ratio is "
            f"only in bypass mode; correction.mode={cfg.correction.mode!r} would regress to pi_old instead: "
            f"expected correction.mode=bypass"
        )
