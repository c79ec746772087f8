"""The kernel contract of the true-on-policy mode, item by item.

Owns the names of the contract's items (``KERNELS``: what each shares between the SGLang server and
the learner), which of them a config turns on (``kernels_of``), and how the launcher tells the server
(``SERVER_ENV`` / ``server_env_value`` / ``kernels_from_env``). ``rollout.true_on_policy`` turns on every
item; ``rollout.true_on_policy_kernels`` names a subset, which is *not* exact: it exists so that
``moe-rl diagnose --attribute`` can turn each item on alone and measure how much mismatch it removes.
Pure Python: the SGLang server process imports it.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["KERNELS", "SERVER_ENV", "kernels_from_env", "kernels_of", "server_env_value"]

KERNELS: dict[str, str] = {
    "linear": "every projection (QKV, attention out, expert and dense MLP weights): row-wise matmul, fp32 sum",
    "lm_head": "the LM head: row-wise matmul with fp32 logits",
    "rmsnorm": "RMSNorm with fp32 statistics; the residual added in the model dtype",
    "attention": "rotate-half RoPE in fp32 and causal attention over exactly the visible keys, one query at a time",
    "activation": "SiLU with every element on torch's vector path",
    "router": "fp32 row-wise router logits; top-k of the logits, softmax over the k",
    "experts": "the routing weight scales the activation before w2; outputs summed in ascending expert id in fp32",
    "log_softmax": "the learner's log-prob as log_softmax(logits / t) (SGLang's deterministic sampler)",
}
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
