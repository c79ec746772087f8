"""Loading a reward function named ``'pkg.module:fn'`` or ``'path/to/file.py:fn'`` (``reward.function``).

Owns the import (a file path is loaded under a private module name, as verl's
``custom_reward_function.path`` is) and the spec check; every failure is a ``ValueError`` naming
``reward.function``. The function is called as ``fn(data_source=, solution_str=, ground_truth=,
extra_info=)``, so a verl reward file works unchanged.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from pathlib import Path

__all__ = ["BUILTIN_FUNCTIONS", "load_function"]

BUILTIN_FUNCTIONS = {
    "math": "moe_rl.reward.builtins:math_score",
    "math_flexible": "moe_rl.reward.builtins:math_flexible_score",
    "exact_match": "moe_rl.reward.builtins:exact_match_score",
}
VERL_ARGS = ("data_source", "solution_str", "ground_truth", "extra_info")


def _from_file(path: Path, spec: str):
    if not path.is_file():
        raise ValueError(f"reward.function={spec!r}: {path} does not exist")
    name = f"moe_rl_reward_{abs(hash(str(path.resolve())))}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def load_function(spec: str):
    """The callable ``spec`` names; ValueError naming ``reward.function`` when it cannot be used."""
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise ValueError(
            f"reward.function={spec!r} must look like 'package.module:function' or 'path/to/file.py:function'"
        )
    try:
        module = (
            _from_file(Path(target).expanduser(), spec) if target.endswith(".py") else importlib.import_module(target)
        )
    except ValueError:
        raise
    except Exception as exc:  # noqa: BLE001 -- a user module failing at import time: one clear error
        raise ValueError(f"reward.function={spec!r} cannot be imported: {type(exc).__name__}: {exc}") from None
    fn = getattr(module, attr, None)
    if fn is None or not callable(fn):
        raise ValueError(f"reward.function={spec!r}: {target} has no callable {attr!r}")
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return fn
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    missing = [a for a in VERL_ARGS if a not in params]
    if missing and not takes_kwargs:
        raise ValueError(
            f"reward.function={spec!r} does not take {missing}; expected verl's signature "
            "fn(data_source, solution_str, ground_truth, extra_info)"
        )
    return fn
