"""The kernel identity of a true-on-policy process: what the shared kernels' bits depend on beyond their code.

Owns ``identity`` (one flat ``{key: str}``), the server's and the learner's views of it, the query of a server's
and the comparison. The shared kernels are row-invariant on one machine, but their bits also depend on the torch
build and on the CPU capability ATen dispatches to (``ATEN_CPU_CAPABILITY``: ``default`` vs ``avx2`` differ in
linear, SiLU, RMSNorm, attention and log-softmax, ``avx2`` vs ``avx512`` in log-softmax), and on the settings the
contract depends on: which items are shared, the dtype both sides round in, deterministic inference. A server and a
learner that differ in any of them lose exactness silently; with this, the learner refuses the batch instead.

* Server: ``moe_rl.rollout.sglang_entry`` serves ``GET IDENTITY_PATH`` -> ``server_identity(dtype, deterministic)``
  (computed in the server's main process; on CPU its scheduler is forked from it with the same environment).
* Rank 0 (``moe_rl.source.batch_maker``) stamps each true-on-policy batch with every server's identity
  (``served_identities``); every learner rank compares it with its own (``learner_identity``) when it loads the
  records (``moe_rl.source.step_records``) and refuses a mismatch naming both (``identity_mismatch``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence

import httpx
import torch

from moe_rl.exact.contract import SERVER_ENV, kernels_from_env, kernels_of

__all__ = [
    "EXTRA_KEY",
    "IDENTITY_PATH",
    "KernelIdentityError",
    "identity",
    "identity_mismatch",
    "learner_identity",
    "served_identities",
    "server_identity",
]

IDENTITY_PATH = "/moe_rl/kernel_identity"
EXTRA_KEY = "kernel_identity"  # RolloutBatch.extra[EXTRA_KEY] = {server address: identity}
MODE_ENV = "MOE_RL_TRUE_ON_POLICY"  # as moe_rl.exact.sglang_hooks.ENV (that module imports torch-heavy SGLang parts)


class KernelIdentityError(RuntimeError):
    """A server cannot say its kernel identity (the CLI prints the message as one line)."""


def identity(kernels: Iterable[str], dtype: str, deterministic: bool) -> dict[str, str]:
    """This process's identity for the contract's ``kernels`` (none: the mode is off), rounding in ``dtype``."""
    return {
        "torch": torch.__version__,
        "torch_build": str(torch.version.git_version),
        "cpu_capability": str(torch.backends.cpu.get_cpu_capability()),
        "kernels": ",".join(sorted(kernels)) or "off",
        "dtype": str(dtype),
        "deterministic": str(bool(deterministic)).lower(),
    }


def server_identity(dtype: str, deterministic: bool, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The SGLang server's identity: the items its hooks install (``MOE_RL_TRUE_ON_POLICY``, ``SERVER_ENV``)."""
    env = os.environ if environ is None else environ
    on = kernels_from_env(env.get(SERVER_ENV)) if env.get(MODE_ENV, "0") == "1" else frozenset()
    return identity(on, dtype, deterministic)


def learner_identity(cfg) -> dict[str, str]:
    """The learner's identity for ``cfg`` (its items, ``precision.params_dtype``, ``rollout.deterministic``)."""
    return identity(kernels_of(cfg.rollout), cfg.precision.params_dtype, cfg.rollout.deterministic)


def served_identities(
    addresses: Sequence[str], headers: Mapping[str, str] | None = None, verify=True, timeout_s: float = 30.0
) -> dict:
    """``{address: identity}`` of every server; KernelIdentityError naming the server when one cannot say."""
    out = {}
    for address in addresses:
        try:
            resp = httpx.get(f"{address}{IDENTITY_PATH}", headers=dict(headers or {}), timeout=timeout_s, verify=verify)
            body = resp.json() if resp.status_code == 200 else None
        except (httpx.HTTPError, ValueError) as err:
            body, resp = None, err
        if not isinstance(body, dict) or not all(isinstance(v, str) for v in body.values()):
            why = f"HTTP {resp.status_code}: {resp.text[:200]}" if isinstance(resp, httpx.Response) else str(resp)
            raise KernelIdentityError(
                f"rollout.true_on_policy: server {address} does not report its kernel identity ({IDENTITY_PATH}: "
                f"{why}); start it through moe_rl.rollout.sglang_entry (every server moe_rl launches does)"
            )
        out[address] = body
    return out


def identity_mismatch(served: Mapping[str, Mapping[str, str]], mine: Mapping[str, str]) -> str | None:
    """One line naming the first server whose identity differs from ``mine``, both identities and the keys that
    differ; None when all agree."""
    for address, theirs in served.items():
        keys = sorted(k for k in set(theirs) | set(mine) if theirs.get(k) != mine.get(k))
        if keys:
            what = ", ".join(f"{k}: server {theirs.get(k)!r} vs learner {mine.get(k)!r}" for k in keys)
            return (
                f"made under another kernel identity than this learner's ({what}); server {address}: {dict(theirs)}; "
                f"learner: {dict(mine)}. rollout.true_on_policy is exact only for one torch build, CPU capability "
                "(ATEN_CPU_CAPABILITY) and set of contract settings on both sides"
            )
    return None
