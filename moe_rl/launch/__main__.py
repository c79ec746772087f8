"""Helpers for the shell launchers in ``launch/``: ``python -m moe_rl.launch {sbatch-args,check-world}``.

Owns nothing but argument plumbing; the rules live in ``plan.py``.
"""

from __future__ import annotations

import argparse
import sys

from moe_rl.config import ConfigError, load_config
from moe_rl.launch.plan import check_learner_world, sbatch_args


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_rl.launch", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="action", required=True)
    p = sub.add_parser("sbatch-args", help="print the sbatch options that allocate cfg.launch's nodes")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", metavar="a.b=value")
    p = sub.add_parser("check-world", help="check that NPROC local ranks fit the parallel sizes")
    p.add_argument("--nproc", type=int, required=True)
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", metavar="a.b=value")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        if args.action == "sbatch-args":
            print(" ".join(sbatch_args(cfg)))
        else:
            dp, edp = check_learner_world(cfg, args.nproc, f"NPROC={args.nproc}")
            print(f"ok: {args.nproc} ranks -> dp {dp}, expert dp {edp}")
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
