"""Preflight rule: ``correction.*`` settings whose function exists but that the training step does not run yet.

Owns the list of such settings and the message naming what is missing: ``correction.prox_logp_method:
loglinear`` (A-3PO, ``moe_rl.algo.proximal.a3po_proximal_logp``) needs the step to skip the old-log-prob
pass and interpolate between μ and π_θ by each token's weight version, which it does not do yet.
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
