"""verl 0.9.1's own loss and correction functions, generated at test time from the pinned PyPI wheel.

The differential tests (tests/algo/test_verl_parity.py) run verl's code, not a transcription of
it, without installing verl (its import pulls ray, omegaconf, transformers, tensordict) and
without committing any of it. ``load()`` fetches the wheel (``pip download verl==0.9.1
--no-deps``, or the file named by $MOE_RL_VERL_WHEEL) into $MOE_RL_CACHE_DIR/verl091 (default
~/.cache/moe_rl/verl091), checks its pinned sha256, copies the named top-level functions (and the estimator enum) out of
its source — each function's text exactly as in the wheel, minus its docstring — into an
importable package ``verl091`` next to it, with config stand-ins whose field defaults are read
from verl's ``ActorConfig`` / ``PolicyLossConfig`` dataclasses, and imports that package.
Every write is atomic (a temp folder, then a rename); a cached wheel or package is reused.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from types import ModuleType

VERSION = "0.9.1"
WHEEL_NAME = f"verl-{VERSION}-py3-none-any.whl"
WHEEL_SHA256 = "db6e6f2a8d9d5808d9ec32d357a42319fdc6967df688ff9d9810050f49bfdd14"  # verl-0.9.1-py3-none-any.whl
WHEEL_ENV = "MOE_RL_VERL_WHEEL"
PACKAGE = "verl091"


class WheelUnavailable(RuntimeError):
    """The pinned wheel could not be obtained or does not match its sha256 (message: one line)."""


# generated module -> (wheel source file, functions copied, header lines)
MODULES = {
    "torch_functional.py": (
        "verl/utils/torch_functional.py",
        ["masked_sum", "masked_mean", "distributed_masked_mean", "masked_var", "masked_whiten"],
        ["import torch"],
    ),
    "core_algos.py": (
        "verl/trainer/ppo/core_algos.py",
        [
            "AdvantageEstimator",
            "register_adv_est",
            "compute_grpo_outcome_advantage",
            "compute_gdpo_outcome_advantage",
            "compute_grpo_passk_outcome_advantage",
            "compute_remax_outcome_advantage",
            "compute_gpg_outcome_advantage",
            "compute_optimal_token_baseline_advantage",
            "compute_multi_turn_optimal_token_baseline_advantage",
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
            "from collections import defaultdict",
            "from enum import Enum",
            "from typing import Any, Callable, Optional",
            "",
            "import numpy as np",
            "import torch",
            "",
            "from . import torch_functional as verl_F",
            "from .config import ActorConfig, AlgoConfig, DictConfig",
            "",
            "PolicyLossFn = Callable",
            "POLICY_LOSS_REGISTRY: dict = {}",
            "ADV_ESTIMATOR_REGISTRY: dict = {}",
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
            "from . import torch_functional as verl_F",
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


def _function_text(source: str, tree: ast.Module, name: str) -> str:
    """The function or class ``name`` (decorators included) exactly as in ``source`` (parsed: ``tree``),
    without its docstring."""
    lines = source.splitlines()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name:
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
    raise WheelUnavailable(f"{name}: not a top-level function or class of the wheel's source")


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
        raise WheelUnavailable(f"{missing}: not found in {CONFIG_SOURCE}")
    return "\n".join(out)


HEADER = '''"""verl {version} — GENERATED by tests/algo/verl_wheel.py from {wheel} (sha256 {sha}); do not edit.

{what} Each function's text is the wheel's, minus its docstring.
Copyright 2024 Bytedance Ltd. and/or its affiliates; Apache License 2.0.
"""

# ruff: noqa
# fmt: off
'''


def render(wheel: Path) -> dict[str, str]:
    """The package's files (name -> text) generated from the wheel, whose sha256 was checked."""
    sha = WHEEL_SHA256
    with zipfile.ZipFile(wheel) as z:
        read = lambda p: z.read(p).decode()
        files = {}
        for out, (src, names, header) in MODULES.items():
            text = read(src)
            tree = ast.parse(text)
            head = HEADER.format(version=VERSION, wheel=wheel.name, sha=sha, what=f"Functions of {src}.")
            files[out] = (
                head + "\n".join(header) + "\n\n\n" + "\n\n\n".join(_function_text(text, tree, n) for n in names) + "\n"
            )
        head = HEADER.format(
            version=VERSION,
            wheel=wheel.name,
            sha=sha,
            what=f"Config stand-ins: the constant field defaults of {CONFIG_SOURCE}.",
        )
        files["config.py"] = head + CONFIG_STANDINS + _config_text(read(CONFIG_SOURCE)) + "\n"
    files["__init__.py"] = (
        '"""verl 0.9.1 functions copied verbatim from the wheel by tests/algo/verl_wheel.py (see core_algos.py)."""\n\n'
        "from . import config, core_algos, rollout_corr_helper, torch_functional  # noqa: F401\n"
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


def _cache() -> Path:
    return Path(os.environ.get("MOE_RL_CACHE_DIR", Path.home() / ".cache" / "moe_rl")) / PACKAGE


def _how() -> str:
    return (
        f"set {WHEEL_ENV}=<path to {WHEEL_NAME}> (pip download verl=={VERSION} --no-deps) "
        f"or restore network access to PyPI"
    )


def _download(cache: Path) -> Path:
    """The wheel from PyPI into ``cache``, atomically: pip writes a temp folder, then a rename."""
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--disable-pip-version-check",
            f"verl=={VERSION}",
            "--no-deps",
            "--only-binary=:all:",
            "-d",
            tmp,
        ]
        done = subprocess.run(cmd, check=False, capture_output=True, text=True)
        got = Path(tmp) / WHEEL_NAME
        if done.returncode != 0 or not got.is_file():
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise WheelUnavailable(f"the verl {VERSION} wheel could not be downloaded ({last}); {_how()}")
        os.replace(got, cache / WHEEL_NAME)
    return cache / WHEEL_NAME


def _checked(wheel: Path) -> Path:
    if not wheel.is_file():
        raise WheelUnavailable(f"{wheel}: no such file (expected {WHEEL_NAME}); {_how()}")
    sha = hashlib.sha256(wheel.read_bytes()).hexdigest()
    if sha != WHEEL_SHA256:
        raise WheelUnavailable(
            f"{wheel}: sha256 {sha}, expected verl {VERSION}'s {WHEEL_SHA256}; "
            f"delete it to download it again, or {_how()}"
        )
    return wheel


def _generate(files: dict[str, str], cache: Path) -> Path:
    """The folder holding package ``verl091`` with exactly ``files``: keyed by their digest, written once."""
    digest = hashlib.sha256("\0".join(f"{n}\0{t}" for n, t in sorted(files.items())).encode()).hexdigest()[:16]
    root = cache / f"generated-{digest}"
    if not (root / PACKAGE / "__init__.py").is_file():
        tmp = Path(tempfile.mkdtemp(dir=cache, prefix=".generate-"))
        tmp.chmod(0o755)
        for name, text in files.items():
            (tmp / PACKAGE).mkdir(exist_ok=True)
            (tmp / PACKAGE / name).write_text(text)
        try:
            os.rename(tmp, root)
        except OSError:  # another process generated it first: identical content, keep theirs
            shutil.rmtree(tmp, ignore_errors=True)
    return root


def load() -> ModuleType:
    """The imported ``verl091`` package (submodules config, core_algos, rollout_corr_helper,
    torch_functional); raises WheelUnavailable with one line saying what to do."""
    cache = _cache()
    given = os.environ.get(WHEEL_ENV)
    if given:
        wheel = _checked(Path(given))
    else:
        cached = cache / WHEEL_NAME
        wheel = _checked(cached if cached.is_file() else _download(cache))
    root = _generate(render(wheel), cache)
    if PACKAGE in sys.modules:
        return sys.modules[PACKAGE]
    spec = importlib.util.spec_from_file_location(
        PACKAGE, root / PACKAGE / "__init__.py", submodule_search_locations=[str(root / PACKAGE)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[PACKAGE] = module  # its relative imports and dataclasses look the package up here
    spec.loader.exec_module(module)
    return module
