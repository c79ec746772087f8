"""Write (or ``--check``) tests/algo/verl091/: verl 0.9.1's own loss and correction functions, verbatim.

The differential tests (tests/algo/test_verl_parity.py) run verl's code, not a transcription of
it, without installing verl (its import pulls ray, omegaconf, transformers, tensordict). This
script copies the named top-level functions out of the PyPI wheel's source — each function's
text exactly as in the wheel, minus its docstring — and generates config stand-ins whose field
defaults are read from verl's ``ActorConfig`` / ``PolicyLossConfig`` dataclasses.

    pip download verl==0.9.1 --no-deps -d /tmp/verl091
    python scripts/verl_extract.py /tmp/verl091/verl-0.9.1-py3-none-any.whl          # write
    python scripts/verl_extract.py /tmp/verl091/verl-0.9.1-py3-none-any.whl --check  # verify
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import sys
import zipfile
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "tests" / "algo" / "verl091"
WHEEL_SHA256 = "db6e6f2a8d9d5808d9ec32d357a42319fdc6967df688ff9d9810050f49bfdd14"  # verl-0.9.1-py3-none-any.whl

# generated module -> (wheel source file, functions copied, header lines)
MODULES = {
    "torch_functional.py": (
        "verl/utils/torch_functional.py",
        ["masked_sum", "masked_mean", "distributed_masked_mean"],
        ["import torch"],
    ),
    "core_algos.py": (
        "verl/trainer/ppo/core_algos.py",
        [
            "register_policy_loss",
            "agg_loss",
            "compute_policy_loss_vanilla",
            "compute_policy_loss_dppo_tv",
            "compute_policy_loss_dppo_kl",
            "compute_policy_loss_gspo",
            "compute_policy_loss_sapo",
            "compute_policy_loss_kl_cov",
            "compute_policy_loss_geo_mean",
            "compute_policy_loss_cispo",
            "kl_penalty",
            "kl_penalty_forward",
            "compute_policy_loss_reinforce",
            "compute_policy_loss_gpg",
        ],
        [
            "from typing import Any, Callable, Optional",
            "",
            "import torch",
            "",
            "import tests.algo.verl091.torch_functional as verl_F",
            "from tests.algo.verl091.config import ActorConfig, AlgoConfig, DictConfig",
            "",
            "PolicyLossFn = Callable",
            "POLICY_LOSS_REGISTRY: dict = {}",
        ],
    ),
    "rollout_corr_helper.py": (
        "verl/trainer/ppo/rollout_corr_helper.py",
        [
            "_parse_rollout_is_threshold",
            "_parse_rollout_rs_thresholds",
            "compute_rollout_rejection_mask",
            "compute_rs_metrics",
            "compute_rollout_correction_weights",
            "compute_is_metrics",
        ],
        [
            "import math",
            "from typing import Any, Optional",
            "",
            "import torch",
            "",
            "import tests.algo.verl091.torch_functional as verl_F",
            "",
            "SAFETY_BOUND = 20.0",
            "SUPPORTED_ROLLOUT_RS_OPTIONS: set[str] = {",
            '    "token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",',
            '    "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3",',
            "}",
            'TOKEN_LEVEL_ROLLOUT_RS_OPTIONS: set[str] = {"token_k1", "token_k2", "token_k3"}',
        ],
    ),
}
CONFIG_SOURCE = "verl/workers/config/actor.py"
CONFIG_CLASSES = ("PolicyLossConfig", "ActorConfig")


def _function_text(source: str, name: str) -> str:
    """The function ``name`` (decorators included) exactly as in ``source``, without its docstring."""
    tree = ast.parse(source)
    lines = source.splitlines()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            start = min([d.lineno for d in node.decorator_list] + [node.lineno]) - 1
            body = lines[start : node.end_lineno]
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                drop = set(range(first.lineno - 1 - start, first.end_lineno - start))
                body = [line for i, line in enumerate(body) if i not in drop]
            return "\n".join(body)
    raise SystemExit(f"{name}: not a top-level function of the wheel's source")


def _config_text(source: str) -> str:
    """Stand-ins for verl's config dataclasses: the constant field defaults, read from the wheel."""
    tree = ast.parse(source)
    out = []
    for node in tree.body:
        if not (isinstance(node, ast.ClassDef) and node.name in CONFIG_CLASSES):
            continue
        out += ["", "", "@dataclass", f"class {node.name}(_Base):"]
        for item in node.body:
            if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) and item.value is not None):
                continue
            name = item.target.id
            if isinstance(item.value, ast.Constant):
                out.append(f"    {name}: Any = {item.value.value!r}")
            elif name == "policy_loss":
                out.append("    policy_loss: Any = field(default_factory=PolicyLossConfig)")
            elif name == "global_batch_info":
                out.append("    global_batch_info: dict = field(default_factory=dict)")
    missing = [c for c in CONFIG_CLASSES if f"class {c}(" not in "\n".join(out)]
    if missing:
        raise SystemExit(f"{missing}: not found in {CONFIG_SOURCE}")
    return "\n".join(out)


HEADER = '''"""verl {version} — GENERATED by scripts/verl_extract.py from {wheel} (sha256 {sha}); do not edit.

{what} Each function's text is the wheel's, minus its docstring.
Copyright 2024 Bytedance Ltd. and/or its affiliates; Apache License 2.0.
"""

# ruff: noqa
# fmt: off
'''


def render(wheel: Path) -> dict[str, str]:
    sha = hashlib.sha256(wheel.read_bytes()).hexdigest()
    if sha != WHEEL_SHA256:
        raise SystemExit(f"{wheel}: sha256 {sha}, expected verl 0.9.1's {WHEEL_SHA256}")
    with zipfile.ZipFile(wheel) as z:
        read = lambda p: z.read(p).decode()  # noqa: E731
        files = {}
        for out, (src, names, header) in MODULES.items():
            text = read(src)
            head = HEADER.format(version="0.9.1", wheel=wheel.name, sha=sha, what=f"Functions of {src}.")
            files[out] = (
                head + "\n".join(header) + "\n\n\n" + "\n\n\n".join(_function_text(text, n) for n in names) + "\n"
            )
        head = HEADER.format(version="0.9.1", wheel=wheel.name, sha=sha,
                             what=f"Config stand-ins: the constant field defaults of {CONFIG_SOURCE}.")  # fmt: skip
        files["config.py"] = head + CONFIG_STANDINS + _config_text(read(CONFIG_SOURCE)) + "\n"
    files["__init__.py"] = (
        '"""verl 0.9.1 functions copied verbatim by scripts/verl_extract.py (see core_algos.py)."""\n'
    )
    return files


CONFIG_STANDINS = """from dataclasses import dataclass, field
from typing import Any


class AlgoConfig:  # verl's AlgoConfig: only an isinstance() target here
    pass


DictConfig = dict  # omegaconf's DictConfig: only a type annotation here


class _Base:
    def get(self, key, default=None):  # verl.base_config.BaseConfig.get: getattr with a default
        return getattr(self, key, default)
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("wheel", type=Path, help="verl-0.9.1-py3-none-any.whl (pip download verl==0.9.1 --no-deps)")
    ap.add_argument("--check", action="store_true", help="fail if tests/algo/verl091 differs from the wheel")
    args = ap.parse_args(argv)
    files = render(args.wheel)
    stale = [n for n, t in files.items() if not (OUT / n).exists() or (OUT / n).read_text() != t]
    if args.check:
        print("verl091: " + (f"differs from the wheel: {stale}" if stale else "identical to the wheel"))
        return 1 if stale else 0
    OUT.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (OUT / name).write_text(text)
    print(f"wrote {len(files)} files to {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
