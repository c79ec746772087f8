"""What a local SGLang server is launched with: its spec, its command line and its environment.

Owns ``ServerSpec`` (mirrors the ``rollout`` config section), the argv (CPU or GPU flags, routed experts always on,
deterministic inference when asked, the sampling-mask cap, API keys by variable name through ``sglang_entry``) and
the environment (the learner's distributed variables removed, CPU stand-ins on the server's path only). It starts
nothing: the process lifecycle is ``launcher``'s; ``moe_rl.launch.plan`` reuses both builders for cluster servers.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

from moe_rl.exact.contract import SERVER_ENV as KERNELS_ENV
from moe_rl.exact.contract import kernels_of, server_env_value

REPO_ROOT = Path(__file__).resolve().parents[2]
STUBS_DIR = REPO_ROOT / "patches" / "stubs"


@dataclass(frozen=True)
class ServerSpec:
    """How to launch one SGLang server for `model_path` (mirrors the `rollout` config section)."""

    model_path: str
    device: str = "cpu"  # "cpu" | "cuda"
    host: str = "127.0.0.1"
    port: int | None = None  # None = a free port
    dtype: str = "float32"
    deterministic: bool = True
    true_on_policy: bool = False  # MOE_RL_TRUE_ON_POLICY=1: patch 0013 routes the forward through moe_rl.exact
    true_on_policy_kernels: str | None = None  # a subset of the contract's items (diagnose --attribute); None = all
    seed: int = 0
    sampling_mask_max_tokens: int = 4096
    mem_fraction_static: float = 0.05
    max_total_tokens: int = 4096
    startup_timeout_s: float | None = 180.0  # None: rollout.startup_timeout_s unset and not derived (start refuses)
    sleep_on_idle: bool = True  # --sleep-on-idle: no busy-wait between rollouts (the learner shares the cores)
    cpu_threads: int | None = None  # CPU engine: torch intra-op threads (None = all cores)
    cpu_affinity: tuple[int, ...] = ()  # rollout.server_cpus: cores the server's processes run on (() = any)
    extra_args: tuple[str, ...] = ()
    api_key_env: str | None = None  # names of the variables holding the keys (never the keys)
    admin_api_key_env: str | None = None

    @classmethod
    def from_rollout_config(cls, rollout, model_path: str | Path, **overrides) -> ServerSpec:
        """Spec from a `moe_rl.config` RolloutConfig; keyword overrides win. An unset ``rollout.startup_timeout_s``
        is derived from the whole config (``moe_rl.sizing.defaults.startup_timeout``): pass it as an override."""
        values = {
            "model_path": str(model_path),
            "device": rollout.device,
            "host": rollout.host,
            "port": rollout.port,
            "dtype": rollout.dtype,
            "deterministic": rollout.deterministic,
            "true_on_policy": rollout.true_on_policy,
            "true_on_policy_kernels": server_env_value(kernels_of(rollout)) if rollout.true_on_policy else None,
            "seed": rollout.seed,
            "sampling_mask_max_tokens": rollout.sampling_mask_max_tokens,
            "mem_fraction_static": rollout.mem_fraction_static,
            "max_total_tokens": rollout.max_total_tokens,
            "startup_timeout_s": rollout.startup_timeout_s,
            "sleep_on_idle": rollout.sleep_on_idle,
            "cpu_affinity": tuple(rollout.server_cpus),
            "extra_args": tuple(rollout.extra_server_args),
            "api_key_env": rollout.api_key_env,
            "admin_api_key_env": rollout.admin_api_key_env,
        }
        values.update(overrides)
        return cls(**values)


def server_command(spec: ServerSpec, port: int, python: str = sys.executable) -> list[str]:
    """The server argv for `spec` on `port`: SGLang's launch_server through `sglang_entry` (keys by variable)."""
    keys = [
        *(("--api-key-env", spec.api_key_env) if spec.api_key_env else ()),
        *(("--admin-api-key-env", spec.admin_api_key_env) if spec.admin_api_key_env else ()),
    ]
    cmd = [
        python,
        "-m",
        "moe_rl.rollout.sglang_entry",
        *keys,
        "--model-path",
        spec.model_path,
        "--device",
        spec.device,
        "--host",
        spec.host,
        "--port",
        str(port),
        "--dtype",
        spec.dtype,
        "--random-seed",
        str(spec.seed),
        "--mem-fraction-static",
        str(spec.mem_fraction_static),
        "--max-total-tokens",
        str(spec.max_total_tokens),
        "--sampling-mask-max-tokens",
        str(spec.sampling_mask_max_tokens),
        # Routing replay (R2/R3) needs the router's top-k of every forwarded token.
        "--enable-return-routed-experts",
        "--skip-server-warmup",
    ]
    if spec.deterministic:
        # Batch-invariant numerics + per-request `sampling_seed`; without the flag the seed is ignored.
        cmd.append("--enable-deterministic-inference")
    if spec.sleep_on_idle:
        cmd.append("--sleep-on-idle")
    return cmd + list(spec.extra_args)


# The learner's launcher (torchrun / torch.distributed) describes *its* process group in these; a
# server started from rank 0 that inherits them joins that rendezvous and never becomes healthy.
_LEARNER_DIST_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def server_env(spec: ServerSpec, base: dict[str, str] | None = None) -> dict[str, str]:
    """The server's environment: the learner's distributed variables removed; on CPU, the CPU engine
    switch and the stand-ins on PYTHONPATH."""
    env = dict(os.environ if base is None else base)
    for key in [k for k in env if k in _LEARNER_DIST_VARS or k.startswith("TORCHELASTIC_")]:
        del env[key]
    if spec.device == "cpu":
        env["SGLANG_USE_CPU_ENGINE"] = "1"  # otherwise is_cpu() is false and CUDA paths are taken
        # Our SIGTERM of the group reaches the scheduler first; SGLang's parent takes that for a crash and sleeps
        # 5 s "to let GPU activity settle" before py-spy / CUDA core dumps: on CPU every stop paid it, for nothing
        for var in ("SGLANG_PYSPY_DUMP_BEFORE_CRASH", "SGLANG_CUDA_COREDUMP_BEFORE_CRASH"):
            env.setdefault(var, "0")
        env.setdefault("MOE_RL_SGLANG_START_METHOD", "fork")  # children inherit the imports (sglang_entry)
        env.setdefault("SGLANG_EXTERNAL_MODEL_PACKAGE", "moe_rl.rollout.sglang_models")  # others load on demand
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(STUBS_DIR), env.get("PYTHONPATH", "")) if p)
        if spec.cpu_threads is not None:
            env["OMP_NUM_THREADS"] = str(spec.cpu_threads)
    env.pop("MOE_RL_TRUE_ON_POLICY", None)
    env.pop(KERNELS_ENV, None)
    if spec.true_on_policy:
        env["MOE_RL_TRUE_ON_POLICY"] = "1"  # read by moe_rl.exact.sglang_hooks (patch 0013)
        if spec.true_on_policy_kernels is not None:
            env[KERNELS_ENV] = spec.true_on_policy_kernels
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env
