"""Write tests/algo/ctpo_reference.json: CTPO's reference loss and gradient on fixed inputs, from the authors' code.

Usage: ``python scripts/ctpo_reference_golden.py /path/to/horizon-llm/CTPO/verl/trainer/ppo/core_algos.py COMMIT``

The CTPO authors' implementation (github.com/horizon-llm/CTPO, ``cum-token-cumprod-la``) is a verl fork,
not on PyPI, so the parity test (tests/algo/test_survey_methods_losses.py) compares against values this
script computed once: it copies ``_compute_policy_loss_cum_token_la_impl`` out of the given file (its text
as is, found with ``ast``), runs it on the inputs below with ``token-mean`` aggregation (a masked token
mean; verl's ``agg_loss`` with no global batch info) and writes its loss and d loss / d log_prob,
with the file's commit.
"""

from __future__ import annotations

import ast
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import ClassVar

import torch

FUNCTION = "_compute_policy_loss_cum_token_la_impl"
OUT = Path(__file__).resolve().parents[1] / "tests" / "algo" / "ctpo_reference.json"
CASES = [  # (la_clip_low, la_clip_high, la_clip_c, power, seed, spread)
    (0.025, 0.05, 0.05, 0.5, 0, 0.05),
    (0.025, 0.05, 0.05, 0.5, 1, 0.3),
    (0.1, 0.2, 0.3, 0.25, 2, 0.2),  # power 0 fails in the reference (torch.exp of a float)
    (0.05, 0.1, 0.08, 1.0, 3, 0.1),
]
MASK = [[1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1], [1, 0, 0, 0, 0, 0]]


class _Config(dict):
    """Stands in for verl's ActorConfig: ``get`` and an empty ``global_batch_info``."""

    global_batch_info: ClassVar[dict] = {}


class _VerlF:
    @staticmethod
    def masked_mean(values, mask, axis=None):
        return (values * mask).sum(axis) / mask.sum(axis).clamp_min(1e-8)


def _agg_loss(loss_mat, loss_mask, loss_agg_mode, **_):
    assert loss_agg_mode == "token-mean"
    return (loss_mat * loss_mask).sum() / loss_mask.sum()


def _reference(path: Path):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == FUNCTION)
    source = ast.get_source_segment(path.read_text(encoding="utf-8"), node)
    namespace = {
        "torch": torch,
        "Optional": __import__("typing").Optional,
        "Any": __import__("typing").Any,
        "ActorConfig": _Config,
        "verl_F": _VerlF,
        "agg_loss": _agg_loss,
    }
    exec(compile(source, str(path), "exec"), namespace)  # noqa: S102 -- running the reference's own text
    return namespace[FUNCTION]


def main(path: str, commit: str) -> None:
    fn = _reference(Path(path))
    mask = torch.tensor(MASK, dtype=torch.float64)
    cases = []
    for lo, hi, c, power, seed, spread in CASES:
        g = torch.Generator().manual_seed(seed)
        old = -torch.rand(4, 6, generator=g, dtype=torch.float64) * 2 - 0.05
        logp = (old + spread * torch.randn(4, 6, generator=g, dtype=torch.float64)).requires_grad_(True)
        adv = torch.randn(4, 6, generator=g, dtype=torch.float64)
        cfg = _Config(la_clip_low=lo, la_clip_high=hi, la_clip_c=c, clip_ratio_la_power=power)
        loss, _ = fn(old, logp, adv, mask, "token-mean", cfg, None, "cumprod")
        (grad,) = torch.autograd.grad(loss, logp)
        cases.append(
            {
                "params": {"ctpo_clip_low": lo, "ctpo_clip_high": hi, "ctpo_clip_c": c, "ctpo_clip_power": power},
                "logp": logp.detach().tolist(),
                "old_logp": old.tolist(),
                "advantages": adv.tolist(),
                "loss": loss.item(),
                "grad": grad.tolist(),
            }
        )
    data = {"source": "github.com/horizon-llm/CTPO verl/trainer/ppo/core_algos.py", "commit": commit}
    data |= {"function": f"{FUNCTION}(ratio_mode='cumprod')", "mask": MASK, "cases": cases}
    fd, tmp = tempfile.mkstemp(dir=OUT.parent, suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    os.replace(tmp, OUT)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
