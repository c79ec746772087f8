"""Preflight rule: ``correction.*`` settings whose function exists but that the training step does not run yet,
and losses that are defined against one correction mode only.

Owns the list of such settings and the message naming what is missing: ``correction.prox_logp_method:
loglinear`` (A-3PO, ``moe_rl.algo.proximal.a3po_proximal_logp``) needs the step to skip the old-log-prob
pass and interpolate between μ and π_θ by each token's weight version, which it does not do yet; ``loss.type:
oapl`` regresses the log-ratio to the rollout policy π_inf (seed 000, OAPL), which is the ratio's anchor only in
``correction.mode: bypass`` (decoupled mode would silently regress to π_old).
"""

from __future__ import annotations

from collections.abc import Iterable


def correction_settings(cfg) -> Iterable[str]:
    """One message per correction setting a run cannot use."""
    if cfg.correction.prox_logp_method == "loglinear":
        yield (
            "correction.prox_logp_method='loglinear' (A-3PO) needs the training step to replace its old-log-prob "
            "pass by the interpolation of moe_rl.algo.a3po_proximal_logp, which it does not do yet; expected "
            "'recompute' (the function is callable on its own: docs/algo.md)"
        )
    if cfg.loss.type == "oapl" and cfg.correction.mode != "bypass":
        yield (
            f"loss.type='oapl' regresses log(pi/pi_inf) with pi_inf the rollout policy, which the loss's ratio is "
            f"only in bypass mode; correction.mode={cfg.correction.mode!r} would regress to pi_old instead: "
            f"expected correction.mode=bypass"
        )
