"""The kernel identity of a true-on-policy process: what the shared kernels' bits depend on beyond their code.

Owns ``identity`` (one flat ``{key: str}``), the server's and the learner's views of it, the query of a server's
and the comparison. The shared kernels are row-invariant on one machine, but their bits also depend on the torch
build and on the CPU capability ATen dispatches to (``ATEN_CPU_CAPABILITY``: ``default`` vs ``avx2`` differ in
linear, SiLU, RMSNorm, attention and log-softmax, ``avx2`` vs ``avx512`` in log-softmax), on the code path MKL
picks for the kernels' GEMM tiles at run time, independently of ATen (``MKL_ENABLE_INSTRUCTIONS=AVX2`` and
``MKL_CBWR=COMPATIBLE`` / ``AVX2`` / ``AUTO,STRICT`` change the tiles' bits on an AVX-512 machine:
``mkl_identity``), and on the settings the contract depends on: which items are shared, the dtype both sides round
in, deterministic inference. A server and a learner that differ in any of them lose exactness silently; with this,
the learner refuses the batch instead. oneDNN is not in it: the exact kernels never call it (measured;
docs/true_on_policy.md).

* Server: ``moe_rl.rollout.sglang_entry`` serves ``GET IDENTITY_PATH`` -> ``server_identity(dtype, deterministic)``
  (computed in the server's main process; on CPU its scheduler is forked from it with the same environment).
* Rank 0 (``moe_rl.source.batch_maker``) stamps each true-on-policy batch with every server's identity
  (``served_identities``); every learner rank compares it with its own (``learner_identity``) when it loads the
  records (``moe_rl.source.step_records``) and refuses a mismatch naming both (``identity_mismatch``).
"""

from __future__ import annotations

import ctypes
import os
import re
from collections.abc import Iterable, Mapping, Sequence

import httpx
import torch

from moe_rl.exact.contract import SERVER_ENV, kernels_from_env, kernels_of

__all__ = [
    "EXTRA_KEY",
    "IDENTITY_PATH",
    "MKL_KEYS",
    "KernelIdentityError",
    "identity",
    "identity_mismatch",
    "learner_identity",
    "mkl_identity",
    "served_identities",
    "server_identity",
]

IDENTITY_PATH = "/moe_rl/kernel_identity"
EXTRA_KEY = "kernel_identity"  # RolloutBatch.extra[EXTRA_KEY] = {server address: identity}
MODE_ENV = "MOE_RL_TRUE_ON_POLICY"  # as moe_rl.exact.sglang_hooks.ENV (that module imports torch-heavy SGLang parts)


MKL_KEYS = ("mkl", "mkl_isa", "mkl_cbwr")  # added 2026-11-28: a server of an older moe_rl reports none of them
NOT_REPORTED = "(not reported)"
# mkl_service.h: mkl_cbwr_get(MKL_CBWR_ALL)'s branch values and its strict flag
_CBWR_ALL, _CBWR_STRICT = -1, 0x10000
_CBWR = {0: "OFF", 1: "OFF", 2: "AUTO", 3: "COMPATIBLE", 4: "SSE2", 6: "SSSE3", 7: "SSE4_1", 8: "SSE4_2", 9: "AVX"}
_CBWR |= {10: "AVX2", 11: "AVX512_MIC", 12: "AVX512", 13: "AVX512_MIC_E1", 14: "AVX512_E1"}


class KernelIdentityError(RuntimeError):
    """A server cannot say its kernel identity (the CLI prints the message as one line)."""


class _MKLVersion(ctypes.Structure):  # mkl_service.h's MKLVersion; the strings start at byte 16 with or
    # without PatchVersion (oneMKL 2024 has it; before, the 3 ints are padded to 16)
    _fields_ = [(n, ctypes.c_int) for n in ("major", "minor", "update", "patch")] + [
        (n, ctypes.c_char_p) for n in ("status", "build", "processor", "platform")
    ]


def _loaded_mkl():
    """The MKL this process already runs (torch's own copy: linked into libtorch_cpu, or a libmkl_* it mapped);
    None when no loaded library exports MKL's service functions (torch exports ``mkl_serv_get_version`` and
    ``mkl_serv_cbwr_get``, not the public ``mkl_get_version`` / ``mkl_cbwr_get``; they answer as those are documented
    to, checked against ``MKL_CBWR``: tests/exact/test_identity.py). Never loads a library (``RTLD_NOLOAD``)."""
    paths = [os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")]
    try:
        with open("/proc/self/maps") as maps:
            paths += sorted({ln.split()[-1] for ln in maps if "mkl" in os.path.basename(ln.split()[-1])})
    except OSError:
        pass
    for path in paths:
        try:
            lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        except OSError:
            continue
        if all(hasattr(lib, f) for f in ("MKL_Get_Version_String", "mkl_serv_get_version", "mkl_serv_cbwr_get")):
            return lib
    return None


def mkl_identity() -> dict[str, str]:
    """MKL's code path for this process's GEMMs, as MKL reports it: ``mkl`` (its version and build), ``mkl_isa``
    (``mkl_get_version``'s processor optimisation: the instruction set it dispatches to, which follows the CPU,
    ``MKL_ENABLE_INSTRUCTIONS`` and ``MKL_CBWR``) and ``mkl_cbwr`` (``mkl_cbwr_get``: the conditional-numerical-
    reproducibility branch, ``OFF`` unless set, ``,STRICT`` appended when strict). MKL reads its variables once, at
    its first call (this one, or an earlier GEMM): what it reports is what it runs from then on. Without MKL in
    torch: ``none``; with an MKL that exports no service functions: the variables that select its path."""
    if not torch.backends.mkl.is_available():
        return dict.fromkeys(MKL_KEYS, "none")
    lib = _loaded_mkl()
    if lib is None:
        version = re.search(r"Math Kernel Library Version (\S+(?: Build \S+)?)", torch.__config__.show())
        return {
            "mkl": version.group(1) if version else "unknown",
            "mkl_isa": f"MKL_ENABLE_INSTRUCTIONS={os.environ.get('MKL_ENABLE_INSTRUCTIONS', '')}",
            "mkl_cbwr": f"MKL_CBWR={os.environ.get('MKL_CBWR', '')}",
        }
    buf = ctypes.create_string_buffer(256)
    lib.MKL_Get_Version_String(buf, ctypes.c_int(len(buf)))
    version = re.search(r"Version (.+?)(?: for |$)", buf.value.decode(errors="replace"))
    info = _MKLVersion()
    lib.mkl_serv_get_version(ctypes.byref(info))
    cbwr = lib.mkl_serv_cbwr_get(ctypes.c_int(_CBWR_ALL))
    branch = _CBWR.get(cbwr & ~_CBWR_STRICT, str(cbwr & ~_CBWR_STRICT))
    return {
        "mkl": version.group(1) if version else buf.value.decode(errors="replace"),
        "mkl_isa": (info.processor or b"unknown").decode(errors="replace"),
        "mkl_cbwr": branch + (",STRICT" if cbwr & _CBWR_STRICT else ""),
    }


def identity(kernels: Iterable[str], dtype: str, deterministic: bool) -> dict[str, str]:
    """This process's identity for the contract's ``kernels`` (none: the mode is off), rounding in ``dtype``."""
    return {
        "torch": torch.__version__,
        "torch_build": str(torch.version.git_version),
        "cpu_capability": str(torch.backends.cpu.get_cpu_capability()),
        **mkl_identity(),
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


def _shown(ident: Mapping[str, str], key: str) -> str:
    return repr(ident[key]) if key in ident else NOT_REPORTED


def identity_mismatch(served: Mapping[str, Mapping[str, str]], mine: Mapping[str, str]) -> str | None:
    """One line naming the first server whose identity differs from ``mine``, both identities and the keys that
    differ; None when all agree. A key one side does not report differs (shown as ``(not reported)``): an identity
    from an older moe_rl, without the MKL keys, is refused rather than trusted."""
    for address, theirs in served.items():
        keys = sorted(k for k in set(theirs) | set(mine) if theirs.get(k) != mine.get(k))
        if keys:
            what = ", ".join(f"{k}: server {_shown(theirs, k)} vs learner {_shown(mine, k)}" for k in keys)
            old = sorted(set(mine) - set(theirs))
            why = f"; server {address} does not report {', '.join(old)} (an older moe_rl: restart it)" if old else ""
            return (
                f"made under another kernel identity than this learner's ({what}){why}; server {address}: "
                f"{dict(theirs)}; learner: {dict(mine)}. rollout.true_on_policy is exact only for one torch build, CPU "
                "capability (ATEN_CPU_CAPABILITY), MKL code path (MKL_ENABLE_INSTRUCTIONS, MKL_CBWR) and set of "
                "contract settings on both sides"
            )
    return None
