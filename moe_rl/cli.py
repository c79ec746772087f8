"""The ``moe-rl`` command line: one subcommand per user task, each importing only what it needs.

Owns argument parsing and exit codes; the work lives in the modules it calls.
"""

from __future__ import annotations

import argparse
import json
import sys

from moe_rl.config import ConfigError, dump_config, load_config
from moe_rl.records import RecordError, RolloutBatch


def _config_validate(args) -> int:
    for path in args.configs:
        cfg = load_config(path, args.overrides)
        print(f"ok: {path} ({cfg.name}: {cfg.model.num_layers} layers, {cfg.model.num_moe_experts} experts, "
              f"routing={cfg.replay.routing}, loss={cfg.loss.type})")  # fmt: skip
    return 0


def _config_show(args) -> int:
    print(dump_config(load_config(args.config, args.overrides)), end="")
    return 0


def _records_inspect(args) -> int:
    for path in args.files:
        batch = RolloutBatch.load(path)
        print(json.dumps({"file": path, **batch.summary()}, indent=2))
    return 0


def _train(args) -> int:
    from moe_rl.train.loop import train
    from moe_rl.train.summary import print_closing_summary

    print_closing_summary(train(load_config(args.config, args.overrides)))
    return 0


def _ablate(args) -> int:
    from moe_rl.ablate import AblationError, run_ablation

    try:
        run_ablation(args.config, args.overrides, out_dir=args.out)
    except AblationError as exc:  # the report was written; say which cells failed
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def _launch(args) -> int:
    from moe_rl.launch import render_launch

    print(render_launch(load_config(args.config, args.overrides), dry_run=args.dry_run))
    return 0


def _diagnose(args) -> int:
    from moe_rl.diagnose import run_diagnose

    cfg = load_config(args.config, args.overrides)
    out = args.out or f"{cfg.train.output_dir}/diagnose"
    numbers = run_diagnose(cfg, args.prompts, out)
    print(f"{numbers['verdict']['summary']}\nreport: {out}/report.md")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moe-rl", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    cfg = sub.add_parser("config", help="validate or print experiment configs").add_subparsers(dest="action", required=True)
    p = cfg.add_parser("validate", help="validate one or more YAML configs")
    p.add_argument("configs", nargs="+")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="a.b=value")
    p.set_defaults(func=_config_validate)
    p = cfg.add_parser("show", help="print the fully resolved config as YAML")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", metavar="a.b=value")
    p.set_defaults(func=_config_show)

    rec = sub.add_parser("records", help="inspect rollout records files").add_subparsers(dest="action", required=True)
    p = rec.add_parser("inspect", help="summary of records files (samples, tokens, bytes per route entry, masks)")
    p.add_argument("files", nargs="+")
    p.set_defaults(func=_records_inspect)

    p = sub.add_parser("train", help="run RL training from a YAML config")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", metavar="a.b=value")
    p.set_defaults(func=_train)

    p = sub.add_parser("ablate", help="run a router-replay ablation grid and write a report")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", metavar="a.b=value")
    p.add_argument("--out", default=None, help="report directory (default: <train.output_dir>/ablation)")
    p.set_defaults(func=_ablate)

    p = sub.add_parser("launch", help="render (or run) the SLURM/torchrun/SGLang commands of a config")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", metavar="a.b=value")
    p.add_argument("--dry-run", action="store_true", help="print the commands instead of running them")
    p.set_defaults(func=_launch)
    p = sub.add_parser("diagnose", help="zero-staleness rollout-vs-learner mismatch report (natural/R3/KSM)")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", metavar="a.b=value")
    p.add_argument("--prompts", type=int, default=8, help="prompts to generate (x rollout.samples_per_prompt)")
    p.add_argument("--out", default=None, help="report directory (default: <train.output_dir>/diagnose)")
    p.set_defaults(func=_diagnose)
    return parser


# Megatron-Core announces its CPU fallbacks on every import; they are expected here (docs/learner.md).
QUIET_WARNINGS = (r".*Transformer Engine and Apex are not installed.*", r"Apex is not installed.*",
                  r"full scope is deprecated.*")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    import warnings

    for pattern in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern, category=UserWarning)
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, RecordError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
