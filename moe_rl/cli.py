"""The ``moe-rl`` command line: one subcommand per user task, each importing only what it needs.

Owns argument parsing and exit codes; the work lives in the modules it calls.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import warnings

from moe_rl import console
from moe_rl.config import ConfigError, dump_config, load_config
from moe_rl.config.memory_plan import launch_world
from moe_rl.records import RecordError, RolloutBatch
from moe_rl.records.summary import batch_summary
from moe_rl.sizing import derived_lines, job_fits, job_plan


def _overrides(args) -> list[str]:
    """Positional ``a.b=value`` items, then ``--set`` ones (the same thing, kept as an alias)."""
    return [*getattr(args, "overrides", []), *getattr(args, "set_overrides", [])]


def _split_validate_items(items: list[str]) -> tuple[list[str], list[str]]:
    """``config validate`` items: an existing path is a config, anything else with ``=`` an override."""

    configs = [i for i in items if os.path.exists(i) or "=" not in i]
    return configs, [i for i in items if i not in configs]


def _checked_config(args, env: bool):
    """Load ``args.config`` with its overrides and run the preflight (``env``: machine checks too)."""
    from moe_rl.preflight import preflight  # noqa: PLC0415 -- imports torch and Megatron

    cfg = load_config(args.config, _overrides(args))
    for note in preflight(cfg, env=env):
        print(f"note: {note}", file=sys.stderr)
    return cfg


def _config_validate(args) -> int:
    from moe_rl.preflight import run_preflight  # noqa: PLC0415 -- imports torch and Megatron
    from moe_rl.preflight.data import unbuilt_model  # noqa: PLC0415 -- imports torch and Megatron

    configs, positional = _split_validate_items(args.items)
    if not configs:
        raise ConfigError("config validate needs at least one YAML config path before the a.b=value overrides")
    overrides = [*positional, *args.set_overrides]
    failed = 0
    for path in configs:
        try:
            cfg = load_config(path, overrides)
        except ConfigError as exc:
            print(f"error: {path}: {exc}", file=sys.stderr)
            failed += 1
            continue
        report = run_preflight(cfg, env=args.env)
        unbuilt = unbuilt_model(cfg)
        if unbuilt in report.problems:  # a fresh clone: say how to build it, check everything else
            report.problems.remove(unbuilt)
            report.notes.append(unbuilt.replace(" to create it;", " before training;") + " (checked without it)")
        for note in report.notes:
            print(f"note: {path}: {note}", file=sys.stderr)
        if report.problems:
            print(f"error: {path} cannot run:\n  " + "\n  ".join(report.problems), file=sys.stderr)
            failed += 1
        else:
            model = (
                "model not built yet"
                if unbuilt
                else f"{cfg.model.num_layers} layers, {cfg.model.num_moe_experts} experts"
            )
            print(f"ok: {path} ({cfg.name}: {model}, routing={cfg.replay.routing}, loss={cfg.loss.type})")
        if not unbuilt:  # the plan needs the model's real sizes
            _print_memory_plan(cfg, path)
    return 2 if failed else 0


def _print_memory_plan(cfg, path: str) -> None:
    """The per-GPU job plan of ``cfg``'s launch layout (moe_rl.sizing), or why there are none."""

    world = launch_world(cfg)
    if world is None:
        ln = cfg.launch
        print(
            f"{path}: no memory plan: launch.learner_nodes*launch.gpus_per_node = "
            f"{ln.learner_nodes * ln.gpus_per_node} ranks do not fit the parallel sizes"
        )
        return
    print(f"{path}: " + "\n  ".join([*job_plan(cfg).lines(), *derived_lines(cfg)]))


def _plan(args) -> int:
    """The job plan of a config (GPU, host, disk, network per rank and node); exit 2 if it does not fit."""
    cfg = load_config(args.config, _overrides(args))
    _print_memory_plan(cfg, args.config)
    problems = list(job_fits(cfg))
    for problem in problems:
        print(f"error: {args.config} does not fit: {problem}", file=sys.stderr)
    return 2 if problems else 0


def _config_show(args) -> int:
    print(dump_config(load_config(args.config, _overrides(args))), end="")
    return 0


def _records_inspect(args) -> int:
    """Summary per readable file; one ``error: FILE: reason`` line per unreadable one (exit 2 if any)."""
    failed = 0
    for path in args.files:
        try:
            batch = RolloutBatch.load(path)
        except RecordError as exc:  # the message starts with the file name
            print(f"error: {exc}", file=sys.stderr)
            failed += 1
            continue
        print(json.dumps({"file": path, **batch_summary(batch)}, indent=2))
        if batch.fingerprint is None:
            print(
                f"note: {path}: no architecture fingerprint or producing run (records from before format 2)",
                file=sys.stderr,
            )
    return 2 if failed else 0


def _train(args) -> int:
    from moe_rl.train.stop_signal import REQUEUE_EXIT_CODE, StopRequest  # noqa: PLC0415 -- a subcommand's subsystems load when it runs

    cfg = load_config(args.config, _overrides(args))
    stop = StopRequest.for_config(cfg)
    with stop.installed():  # armed before the heavy imports: SLURM's warning may come at any time
        cfg = _checked_config(args, env=True)
        from moe_rl.study.summary import print_closing_summary  # noqa: PLC0415 -- a subcommand's subsystems load when it runs
        from moe_rl.train.loop import train  # noqa: PLC0415 -- a subcommand's subsystems load when it runs

        run_dir = train(cfg, stop)
    if stop.stopped_after is not None:
        print(
            f"moe_rl: stopped after step {stop.stopped_after} of {cfg.train.steps} on SLURM's warning signal "
            f"(launch.signal={cfg.launch.signal}); checkpoint written; exit {REQUEUE_EXIT_CODE}: requeue to resume",
            file=sys.stderr,
            flush=True,
        )
        return REQUEUE_EXIT_CODE
    print_closing_summary(run_dir)
    return 0


def _ablate(args) -> int:
    from moe_rl.study.ablate import AblationError, run_ablation  # noqa: PLC0415 -- a subcommand's subsystems load when it runs

    _checked_config(args, env=True)
    try:
        run_ablation(args.config, _overrides(args), out_dir=args.out)
    except AblationError as exc:  # the report was written; say which cells failed
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def _launch(args) -> int:
    from moe_rl.launch import render_launch  # noqa: PLC0415 -- a subcommand's subsystems load when it runs

    # Config rules only: the machine checks run in the launched `moe-rl train` on the allocation.
    print(render_launch(_checked_config(args, env=False), dry_run=args.dry_run))
    return 0


def _diagnose(args) -> int:
    from moe_rl.study.diagnose import run_diagnose  # noqa: PLC0415 -- a subcommand's subsystems load when it runs

    cfg = _checked_config(args, env=True)
    out = args.out or f"{cfg.train.output_dir}/diagnose"
    if args.attribute:
        kernels = [k for k in args.kernels.split(",") if k] if args.kernels else None
        from moe_rl.study.attribute import run_attribute  # noqa: PLC0415 -- a subcommand's subsystems load when it runs

        run_attribute(cfg, args.prompts, out, kernels=kernels)
        with open(f"{out}/attribution.md") as table:
            print(f"{table.read()}report: {out}/attribution.md")
        return 0
    numbers = run_diagnose(cfg, args.prompts, out)
    print(f"{numbers['verdict']['summary']}\nreport: {out}/report.md")
    return 0


def _certify(args) -> int:
    from moe_rl.study.certify import run_certify  # noqa: PLC0415 -- a subcommand's subsystems load when it runs

    if args.prompts < 1:
        raise ConfigError(f"certify --prompts={args.prompts}; expected >= 1")
    cfg = _checked_config(args, env=True)
    kernels = [k for k in args.kernels.split(",") if k] if args.kernels else None
    return 0 if run_certify(cfg, args.prompts, kernels=kernels, json_path=args.json)["passed"] else 1


def _add_set_alias(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--set",
        dest="set_overrides",
        action="append",
        default=[],
        metavar="a.b=value",
        help="an override, same as a positional a.b=value",
    )


class _Parser(argparse.ArgumentParser):
    """Takes ``a.b=value`` overrides anywhere on the line, also after options such as ``--set``."""

    def parse_args(self, args=None, namespace=None):
        ns, extra = self.parse_known_args(args, namespace)
        dest = "items" if hasattr(ns, "items") else "overrides" if hasattr(ns, "overrides") else None
        unknown = [e for e in extra if dest is None or e.startswith("-") or "=" not in e]
        if unknown:
            self.error(f"unrecognized arguments: {' '.join(unknown)}")
        if extra:
            setattr(ns, dest, [*getattr(ns, dest), *extra])
        return ns


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="moe-rl", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    cfg = sub.add_parser("config", help="validate or print experiment configs").add_subparsers(
        dest="action", required=True
    )
    p = cfg.add_parser(
        "validate", help="validate YAML configs and run the preflight (config rules; --env: machine too)"
    )
    p.add_argument("items", nargs="+", metavar="CONFIG|a.b=value", help="config paths, then overrides for each")
    _add_set_alias(p)
    p.add_argument("--env", action="store_true", help="also check this machine (GPU, TE, WORLD_SIZE, servers)")
    p.set_defaults(func=_config_validate)
    p = cfg.add_parser("show", help="print the fully resolved config as YAML")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", metavar="a.b=value")
    _add_set_alias(p)
    p.set_defaults(func=_config_show)

    p = sub.add_parser("plan", help="size a job: GPU, host, disk and network per rank and per node (moe_rl.sizing)")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", metavar="a.b=value")
    _add_set_alias(p)
    p.set_defaults(func=_plan)

    rec = sub.add_parser("records", help="inspect rollout records files").add_subparsers(dest="action", required=True)
    p = rec.add_parser(
        "inspect",
        help="summary of records files (samples, tokens, route bytes, masks, producing run, architecture fingerprint)",
    )
    p.add_argument("files", nargs="+")
    p.set_defaults(func=_records_inspect)

    p = sub.add_parser("train", help="run RL training from a YAML config")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", metavar="a.b=value")
    _add_set_alias(p)
    p.set_defaults(func=_train)

    p = sub.add_parser("ablate", help="run a router-replay ablation grid and write a report")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", metavar="a.b=value")
    _add_set_alias(p)
    p.add_argument("--out", default=None, help="report directory (default: <train.output_dir>/ablation)")
    p.set_defaults(func=_ablate)

    p = sub.add_parser("launch", help="render (or run) the SLURM/torchrun/SGLang commands of a config")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", metavar="a.b=value")
    _add_set_alias(p)
    p.add_argument("--dry-run", action="store_true", help="print the commands instead of running them")
    p.set_defaults(func=_launch)
    p = sub.add_parser("diagnose", help="zero-staleness rollout-vs-learner mismatch report (natural/R3/KSM)")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", metavar="a.b=value")
    _add_set_alias(p)
    p.add_argument("--prompts", type=int, default=8, help="prompts to generate (x rollout.samples_per_prompt)")
    p.add_argument("--out", default=None, help="report directory (default: <train.output_dir>/diagnose)")
    p.add_argument(
        "--attribute",
        action="store_true",
        help="the true-on-policy kernel contract item by item: "
        "how much mismatch each item removes when turned on alone (docs/true_on_policy.md)",
    )
    p.add_argument("--kernels", default=None, help="--attribute: comma-separated items (default: all of them)")
    p.set_defaults(func=_diagnose)
    p = sub.add_parser(
        "certify",
        help="gate for CI: the zero-staleness check against a real server; exit 1 on any rollout-vs-learner difference",
        description="Generate with an SGLang server (started from the config, or rollout.addresses), recompute the "
        "same tokens with the learner (no update in between) and print max |Δlogp|, KL k3 and router flips. "
        "Exit 0 only when rollout.true_on_policy is on and every number is exactly 0.0; exit 1 on any difference "
        "(always in normal mode, where a difference is expected: it then prints the attribution table of "
        "'moe-rl diagnose --attribute', one server per row, where the config allows); exit 2 on a config error. "
        "docs/true_on_policy.md, 'certify'.",
    )
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", metavar="a.b=value")
    _add_set_alias(p)
    p.add_argument(
        "--prompts", type=int, default=16, help="prompts to generate (x rollout.samples_per_prompt; default: 16)"
    )
    p.add_argument("--json", default=None, metavar="PATH", help="also write the numbers and the verdict to PATH")
    p.add_argument(
        "--kernels", default=None, help="normal mode's attribution table: comma-separated items (default: all)"
    )
    p.set_defaults(func=_certify)
    return parser


# Megatron-Core announces its CPU fallbacks on every import; they are expected here (docs/learner.md).
QUIET_WARNINGS = (
    r".*Transformer Engine and Apex are not installed.*",
    r"Apex is not installed.*",
    r"full scope is deprecated.*",
)


# Errors that carry a complete message for the user, in modules a subcommand imports only when it needs them.
USER_ERRORS = (
    ("moe_rl.learner.checkpoint", "CheckpointError"),
    ("moe_rl.train.resume_rules", "RunDirError"),
    ("moe_rl.rollout.auth", "ServerKeyError"),
    ("moe_rl.sync.integrity", "WeightVersionError"),
    ("moe_rl.data.loaders", "DataError"),
    ("moe_rl.reward.scorer", "RewardError"),
    ("moe_rl.train.kl_alarm", "KLAlarmStop"),
    ("moe_rl.rollout.launcher", "ServerStartError"),
    ("moe_rl.sync.transport", "WeightSyncError"),
    ("moe_rl.source.rollout_restart", "RolloutProcessError"),
    ("moe_rl.rollout.replies", "RolloutError"),  # a batch no server would generate (named with the reply)
    ("moe_rl.exact.identity", "KernelIdentityError"),
)


def _loaded_error_types() -> tuple[type, ...]:
    """The USER_ERRORS classes whose modules are imported (an exception can only come from those)."""
    return tuple(getattr(sys.modules[m], name) for m, name in USER_ERRORS if m in sys.modules)


def main(argv: list[str] | None = None) -> int:
    for pattern in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern, category=UserWarning)
    args = build_parser().parse_args(argv)
    console.install()  # log lines around the progress bar, once per job (rank 0)
    # SIGTERM stops as Ctrl-C does (launch.signal=TERM: the run's StopRequest takes it over while it is armed)
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, console.raise_terminated)
    caller_groups = _distributed_initialized()  # an embedding caller's groups (a test's) are not the command's
    try:
        rc = args.func(args)
    except Exception as exc:
        if not isinstance(exc, (ConfigError, RecordError, *_loaded_error_types())):
            raise
        print(f"error: {exc}", file=sys.stderr)
        rc = 2  # every rank fails alike on these (decided on rank 0), so the groups can be torn down together
    except (KeyboardInterrupt, console.Terminated) as exc:  # the finally blocks on the way out stopped the servers
        terminated = isinstance(exc, console.Terminated)  # and released the lock
        what, rc = (f"terminated ({exc.name})", 128 + exc.signum) if terminated else ("interrupted (Ctrl-C)", 130)
        print(f"{what}: stopped; rerun the same command to resume from the last checkpoint", file=sys.stderr)
        return rc
    if not caller_groups:
        _close_distributed()
    return rc


def _distributed_initialized() -> bool:
    """Whether a default process group exists (without importing torch for commands that never do)."""
    return "torch.distributed" in sys.modules and sys.modules["torch.distributed"].is_initialized()


def _close_distributed() -> None:
    """Tear down the process groups a command opened (NCCL warns at exit about a group never destroyed)."""
    if "torch.distributed" not in sys.modules:  # config and launch commands never import torch
        return
    from moe_rl.learner.dist import destroy_distributed  # noqa: PLC0415 -- a subcommand's subsystems load when it runs

    destroy_distributed()


if __name__ == "__main__":
    sys.exit(main())
