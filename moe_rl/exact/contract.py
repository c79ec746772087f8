"""The kernel contract of the true-on-policy mode, item by item.

Owns which of the contract's items (``moe_rl.config.kernels.KERNELS``: what each shares between the SGLang
server and the learner) a config turns on (``kernels_of``), and how the launcher tells the server
(``SERVER_ENV`` / ``server_env_value`` / ``kernels_from_env``). ``rollout.true_on_policy`` turns on every
item; ``rollout.true_on_policy_kernels`` names a subset, which is *not* exact: it exists so that
``moe-rl diagnose --attribute`` can turn each item on alone and measure how much mismatch it removes.
Pure Python: the SGLang server process imports it.
"""

from __future__ import annotations

from collections.abc import Iterable

from moe_rl.config.kernels import KERNELS

__all__ = ["SERVER_ENV", "kernels_from_env", "kernels_of", "server_env_value"]

SERVER_ENV = "MOE_RL_TRUE_ON_POLICY_KERNELS"  # beside MOE_RL_TRUE_ON_POLICY=1 (patch 0013); absent = all


def _check(names: Iterable[str], where: str) -> frozenset[str]:
    names = frozenset(n.strip() for n in names if n.strip())
    unknown = sorted(names - KERNELS.keys())
    if unknown:
        raise ValueError(f"{where}: unknown kernel(s) {unknown}; expected some of {sorted(KERNELS)}")
    return names


def kernels_of(rollout) -> frozenset[str]:
    """The items a rollout config turns on: none without ``true_on_policy``, else all or the named subset."""
    if not getattr(rollout, "true_on_policy", False):
        return frozenset()
    named = getattr(rollout, "true_on_policy_kernels", None)
    return frozenset(KERNELS) if named is None else _check(named, "rollout.true_on_policy_kernels")


def server_env_value(kernels: Iterable[str]) -> str | None:
    """``SERVER_ENV``'s value for ``kernels`` (``None``: every item, the variable is left unset)."""
    kernels = _check(kernels, "server kernels")
    return None if kernels == frozenset(KERNELS) else ",".join(sorted(kernels))


def kernels_from_env(value: str | None) -> frozenset[str]:
    """The items named by ``SERVER_ENV`` (unset: all)."""
    return frozenset(KERNELS) if value is None else _check(value.split(","), SERVER_ENV)
