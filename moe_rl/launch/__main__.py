"""Helpers for the shell launchers in ``launch/``: ``python -m moe_rl.launch {sbatch-args,check-world,init-hf,serve}``.

Owns argument plumbing and writing a job's initial HF checkpoint; the rules live in ``plan.py``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

from moe_rl.config import ConfigError, load_config
from moe_rl.launch.checks import check_learner_world
from moe_rl.launch.plan import sbatch_args
from moe_rl.launch.serve import add_arguments as add_serve_arguments
from moe_rl.launch.serve import serve
from moe_rl.learner.hf_init import write_random_hf_checkpoint


def write_initial_hf(cfg, out: Path) -> str:
    """A random-init HF checkpoint of ``cfg.model`` at ``out`` (seed ``train.seed``), written to a temporary
    directory and renamed into place; an existing one is kept (a requeued job serves the same files)."""
    if (out / "config.json").is_file():
        return f"kept {out}"

    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(out, ignore_errors=True)  # an incomplete one (no config.json)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    try:
        write_random_hf_checkpoint(cfg.model, tmp, seed=cfg.train.seed)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return f"wrote {out}"


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
    p = sub.add_parser(
        "init-hf", help="write the random-init HF checkpoint a job's servers start from (kept if present)"
    )
    p.add_argument("config")
    p.add_argument("out")
    p = sub.add_parser("serve", help="a rollout step's server on the first free port of a range (SLURM job script)")
    add_serve_arguments(p)
    args = parser.parse_args(argv)
    if args.action == "serve":
        server = args.server[1:] if args.server[:1] == ["--"] else args.server
        return serve(server, args.first_port, args.port_tries, args.port_file, args.startup_timeout)
    try:
        cfg = load_config(args.config, getattr(args, "overrides", []))
        if args.action == "init-hf":
            print(write_initial_hf(cfg, Path(args.out)))
        elif args.action == "sbatch-args":
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
