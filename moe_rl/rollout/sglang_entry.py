"""``python -m moe_rl.rollout.sglang_entry``: SGLang's launch_server with API keys from the environment.

Owns keeping keys out of sight: ``--api-key-env NAME`` / ``--admin-api-key-env NAME`` name variables whose
values become ``ServerArgs.api_key`` / ``admin_api_key`` inside this process, so no key is on any command
line (``ps``, the rendered SLURM plan) and SGLang's ``server_args=...`` log line shows ``<redacted>``.
Every other argument goes to SGLang unchanged; ``--api-key`` itself is refused. Every server moe_rl
launches starts here (with or without keys).

It also keeps one multiprocessing semaphore from being made at all: SGLang spawns its scheduler, which
imports this module as ``__mp_main__``, and tqdm's default write lock there is a ``multiprocessing.RLock``:
under the spawn start method a named POSIX semaphore ``/dev/shm/sem.mp-*`` that only a finalizer removes,
and a stopped server's processes are killed (SGLang even SIGKILLs its own resource tracker), so one
``sem.mp-*`` outlived every run. A thread lock is all tqdm needs in a server log.

On CPU (``MOE_RL_SGLANG_START_METHOD=fork``, set by ``server_spec.server_env``) SGLang's scheduler and
detokenizer are forked, not spawned: they inherit the ~13 s of imports the parent has already done instead of
repeating them on the same cores (a tiny server's start 38 s -> 23 s on the 2-core CI machine). At that point
the parent has only imported modules and parsed its arguments. On GPUs SGLang's ``spawn`` stays: CUDA cannot
be used in a forked child.

A server whose launcher is gone stops itself and its children (``moe_rl.rollout.orphan_guard``, started
first thing in ``main`` when ``MOE_RL_PARENT_PID`` is set).

Every server also answers ``GET /moe_rl/kernel_identity`` (``moe_rl.exact.identity``: torch build, CPU capability, MKL's
code path, the true-on-policy items, dtype, deterministic inference), which the learner compares with its own.
"""

from __future__ import annotations

import multiprocessing
import os
import sys

from moe_rl.exact.identity import IDENTITY_PATH, server_identity
from moe_rl.rollout.orphan_guard import ENV as ORPHAN_ENV
from moe_rl.rollout.orphan_guard import watch_parent


def _tqdm_without_a_semaphore() -> None:
    """tqdm's write lock without its multiprocessing part (runs in every process that imports this module)."""
    try:
        from tqdm.std import TqdmDefaultWriteLock  # noqa: PLC0415 -- optional dependency (guarded by its ImportError)
    except ImportError:
        return
    if not hasattr(TqdmDefaultWriteLock, "mp_lock"):
        TqdmDefaultWriteLock.mp_lock = None  # create_mp_lock() then skips multiprocessing.RLock()


_tqdm_without_a_semaphore()


def _keep_start_method(method: str) -> None:
    """Make SGLang's ``mp.set_start_method("spawn", force=True)`` set ``method`` instead."""

    real = multiprocessing.set_start_method

    def set_start_method(_requested: str, force: bool = False) -> None:
        real(method, force=True)

    multiprocessing.set_start_method = set_start_method


KEY_FLAGS = {"--api-key-env": "api_key", "--admin-api-key-env": "admin_api_key"}
REDACTED = "<redacted>"


def split_key_flags(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """``({server_args field: variable name}, remaining argv)``; SystemExit on a literal key flag."""
    names, rest, it = {}, [], iter(argv)
    for arg in it:
        flag, eq, value = arg.partition("=")
        if flag in KEY_FLAGS:
            names[KEY_FLAGS[flag]] = value if eq else next(it, "")
        elif flag in ("--api-key", "--admin-api-key"):
            raise SystemExit(f"error: {flag} on the command line is visible to every user; use rollout.api_key_env")
        else:
            rest.append(arg)
    return names, rest


def _redacting(log_view, secrets: tuple[str, ...]):
    def view(server_args):
        shown = log_view(server_args)
        if isinstance(shown, dict):
            shown = {k: (REDACTED if v in secrets else v) for k, v in shown.items()}
        return shown

    return view


def _flag_value(argv: list[str], flag: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def _serve_identity(app, sglang_argv: list[str]) -> None:
    """``GET IDENTITY_PATH`` on SGLang's app: this server's kernel identity (no secret in it)."""
    ident = server_identity(
        _flag_value(sglang_argv, "--dtype") or "auto", "--enable-deterministic-inference" in sglang_argv
    )
    app.add_api_route(IDENTITY_PATH, lambda: ident, methods=["GET"])


def main(argv: list[str] | None = None) -> None:
    if parent := os.environ.get(ORPHAN_ENV):  # set by the launcher: go down with it (moe_rl.rollout.orphan_guard)
        watch_parent(int(parent))
    names, sglang_argv = split_key_flags(list(sys.argv[1:] if argv is None else argv))
    keys = {}
    for field, name in names.items():
        if not os.environ.get(name):
            raise SystemExit(f"error: {name} (the {field} variable) is not set or empty")
        keys[field] = os.environ[name]

    from sglang.launch_server import run_server  # noqa: PLC0415 -- SGLang is optional (the rollout engine), heavy to import
    from sglang.srt.entrypoints import engine  # noqa: PLC0415 -- SGLang is optional (the rollout engine), heavy to import
    from sglang.srt.entrypoints.http_server import app  # noqa: PLC0415 -- SGLang is optional (the rollout engine), heavy to import
    from sglang.srt.plugins import load_plugins  # noqa: PLC0415 -- SGLang is optional (the rollout engine), heavy to import
    from sglang.srt.server_args import prepare_server_args  # noqa: PLC0415 -- SGLang is optional (the rollout engine), heavy to import
    from sglang.srt.utils import kill_process_tree  # noqa: PLC0415 -- SGLang is optional (the rollout engine), heavy to import

    if method := os.environ.get("MOE_RL_SGLANG_START_METHOD"):
        _keep_start_method(method)
    engine._server_args_for_logging = _redacting(engine._server_args_for_logging, tuple(keys.values()))
    load_plugins()
    server_args = prepare_server_args(sglang_argv)
    _serve_identity(app, sglang_argv)
    for field, value in keys.items():
        setattr(server_args, field, value)
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


if __name__ == "__main__":
    main()
