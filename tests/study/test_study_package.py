"""The study flow lives in one package (``moe_rl.study``); the package root holds only the CLI."""

from __future__ import annotations

import importlib
from pathlib import Path

import moe_rl
from moe_rl.cli import build_parser

STUDY_MODULES = ("ablate", "report", "diagnose", "diagnose_report", "attribute", "certify")


def test_study_modules_import_from_the_study_package():
    for name in STUDY_MODULES:
        module = importlib.import_module(f"moe_rl.study.{name}")
        assert Path(module.__file__).parent.name == "study"


def test_package_root_holds_no_loose_study_modules():
    root = Path(moe_rl.__file__).parent
    assert sorted(p.name for p in root.glob("*.py")) == ["__init__.py", "cli.py"]


def test_cli_subcommands_still_reach_the_study_flow():
    args = build_parser().parse_args(["ablate", "configs/ablation_replay.yaml"])
    assert args.func.__name__ == "_ablate"
    args = build_parser().parse_args(["diagnose", "configs/tiny_cpu.yaml"])
    assert args.func.__name__ == "_diagnose"
    args = build_parser().parse_args(["certify", "configs/tiny_cpu.yaml", "rollout.dtype=float32"])
    assert args.func.__name__ == "_certify" and args.prompts == 16 and args.overrides == ["rollout.dtype=float32"]
