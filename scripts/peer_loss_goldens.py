"""Write a golden file of a peer implementation's loss and gradient on fixed inputs: CTPO or VESPO, from the authors' code.

Usage: ``python scripts/peer_loss_goldens.py ctpo|vespo|aspo|a3po PATH COMMIT``

- ctpo: github.com/horizon-llm/CTPO ``verl/trainer/ppo/core_algos.py``, function
  ``_compute_policy_loss_cum_token_la_impl`` (loss ``cum-token-cumprod-la``) -> tests/algo/ctpo_reference.json
- vespo: github.com/FloyedShen/VESPO ``recipe/vespo/code/core_algos.py``, function
  ``compute_policy_loss_vespo`` -> tests/algo/vespo_reference.json
- aspo: github.com/zyh1999/ASPO (Archer2.0's code) ``verl/trainer/ppo/core_algos.py``, function
  ``compute_policy_loss_archer`` with one entropy class (the same bounds for both) -> tests/algo/aspo_reference.json
- a3po: github.com/inclusionAI/AReaL ``areal/trainer/ppo/actor.py``, function
  ``compute_prox_logp_approximations(method="loglinear")`` -> tests/algo/a3po_reference.json (the
  approximated proximal log-probs instead of a loss and gradient)

Both are verl forks, not on PyPI, so the parity tests (tests/algo/test_survey_methods_losses.py) compare
against values this script computed once: it copies the function out of the given file (its text as is,
found with ``ast``), runs it on the inputs below with ``token-mean`` aggregation (a masked token mean:
verl's ``agg_loss`` with no global batch info) and writes its loss and d loss / d log_prob, with the
file's commit. The functions' metrics are not compared.
"""

from __future__ import annotations

import ast
import json
import os
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar, Optional

import torch

TESTS = Path(__file__).resolve().parents[1] / "tests" / "algo"
MASK = [[1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1], [1, 0, 0, 0, 0, 0]]
PEERS = {
    "ctpo": {
        "source": "github.com/horizon-llm/CTPO verl/trainer/ppo/core_algos.py",
        "function": "_compute_policy_loss_cum_token_la_impl",
        "out": TESTS / "ctpo_reference.json",
        # (params, seed, spread); power 0 fails in the reference (torch.exp of a float)
        "cases": [
            ({"ctpo_clip_low": 0.025, "ctpo_clip_high": 0.05, "ctpo_clip_c": 0.05, "ctpo_clip_power": 0.5}, 0, 0.05),
            ({"ctpo_clip_low": 0.025, "ctpo_clip_high": 0.05, "ctpo_clip_c": 0.05, "ctpo_clip_power": 0.5}, 1, 0.3),
            ({"ctpo_clip_low": 0.1, "ctpo_clip_high": 0.2, "ctpo_clip_c": 0.3, "ctpo_clip_power": 0.25}, 2, 0.2),
            ({"ctpo_clip_low": 0.05, "ctpo_clip_high": 0.1, "ctpo_clip_c": 0.08, "ctpo_clip_power": 1.0}, 3, 0.1),
        ],
    },
    "aspo": {
        "source": "github.com/zyh1999/ASPO verl/trainer/ppo/core_algos.py",
        "function": "compute_policy_loss_archer",
        "out": TESTS / "aspo_reference.json",
        "cases": [
            ({"clip_low": 0.2, "clip_high": 0.2, "aspo_dual_clip_c_pos": 3.0, "aspo_dual_clip_c_neg": 3.0}, 0, 0.1),
            ({"clip_low": 0.2, "clip_high": 0.28, "aspo_dual_clip_c_pos": 3.0, "aspo_dual_clip_c_neg": 3.0}, 1, 0.6),
            ({"clip_low": 0.1, "clip_high": 0.3, "aspo_dual_clip_c_pos": 1.5, "aspo_dual_clip_c_neg": 2.0}, 2, 1.0),
        ],
    },
    "vespo": {
        "source": "github.com/FloyedShen/VESPO recipe/vespo/code/core_algos.py",
        "function": "compute_policy_loss_vespo",
        "out": TESTS / "vespo_reference.json",
        "cases": [  # advantages constant per sequence, as the reference reads advantages[:, 0]
            ({"vespo_k_pos": 2.0, "vespo_lambda_pos": 3.0, "vespo_k_neg": 3.0, "vespo_lambda_neg": 2.0}, 0, 0.1),
            ({"vespo_k_pos": 2.0, "vespo_lambda_pos": 3.0, "vespo_k_neg": 3.0, "vespo_lambda_neg": 2.0}, 1, 0.4),
            ({"vespo_k_pos": 1.0, "vespo_lambda_pos": 1.5, "vespo_k_neg": 4.0, "vespo_lambda_neg": 2.5}, 2, 0.2),
        ],
    },
}


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


def _function(path: Path, name: str):
    text = path.read_text(encoding="utf-8")
    node = next(n for n in ast.parse(text).body if isinstance(n, ast.FunctionDef) and n.name == name)
    source = ast.get_source_segment(text, node)
    source = "\n".join(line for line in source.splitlines() if not line.startswith("@"))  # no registration
    namespace = {"torch": torch, "Optional": Optional, "Any": Any, "ActorConfig": _Config, "verl_F": _VerlF}
    namespace["agg_loss"] = _agg_loss
    namespace |= {"PROX_APPROX_METHOD_LOGLINEAR": "loglinear", "PROX_APPROX_METHOD_LINEAR": "linear"}
    namespace |= {
        "PROX_APPROX_METHOD_ROLLOUT": "rollout",
        "PROX_APPROX_METHODS_ALL": ["loglinear", "linear", "rollout"],
    }
    exec(compile(source, str(path), "exec"), namespace)  # noqa: S102 -- running the reference's own text
    return namespace[name]


def _call(peer: str, fn, old, logp, adv, mask, params):
    if peer == "ctpo":
        cfg = _Config(
            la_clip_low=params["ctpo_clip_low"],
            la_clip_high=params["ctpo_clip_high"],
            la_clip_c=params["ctpo_clip_c"],
            clip_ratio_la_power=params["ctpo_clip_power"],
        )
        return fn(old, logp, adv, mask, "token-mean", cfg, None, "cumprod")[0]
    if peer == "aspo":
        lo, hi = params["clip_low"], params["clip_high"]
        c_neg, c_pos = params["aspo_dual_clip_c_neg"], params["aspo_dual_clip_c_pos"]
        ones = torch.ones_like(mask, dtype=torch.bool)
        return fn(old, logp, adv, mask.bool(), ones, lo, lo, hi, hi, c_neg, c_pos, False, "token-mean")[0]
    vespo = {key.removeprefix("vespo_"): value for key, value in params.items()}
    cfg = SimpleNamespace(policy_loss={"vespo": vespo})
    return fn(old, logp, adv, mask, "token-mean", cfg, None)[0]


def _a3po(path: str, commit: str) -> None:
    fn = _function(Path(path), "compute_prox_logp_approximations")
    g = torch.Generator().manual_seed(0)
    behav = -torch.rand(4, 6, generator=g, dtype=torch.float64) * 2 - 0.05
    theta = behav + 0.3 * torch.randn(4, 6, generator=g, dtype=torch.float64)
    versions = torch.tensor([[7, 7, 6, 6, 5, 3], [8, 8, 8, 7, 7, 7], [2, 4, 6, 7, 8, 9], [-1, -1, 5, 5, 5, 5]])
    current = 8
    prox = fn(old_logp=behav, logprobs=theta, versions=versions, current_version=current, method="loglinear")
    data = {"source": "github.com/inclusionAI/AReaL areal/trainer/ppo/actor.py", "commit": commit}
    data |= {"function": "compute_prox_logp_approximations(method='loglinear')", "current_version": current}
    data |= {"rollout_logp": behav.tolist(), "logp": theta.tolist(), "token_versions": versions.tolist()}
    data["prox_logp"] = prox["loglinear"].tolist()
    _write(TESTS / "a3po_reference.json", data)


def _write(out: Path, data: dict) -> None:
    fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    os.replace(tmp, out)


def main(peer: str, path: str, commit: str) -> None:
    if peer == "a3po":
        _a3po(path, commit)
        return
    spec = PEERS[peer]
    fn = _function(Path(path), spec["function"])
    mask = torch.tensor(MASK, dtype=torch.float64)
    cases = []
    for params, seed, spread in spec["cases"]:
        g = torch.Generator().manual_seed(seed)
        old = -torch.rand(4, 6, generator=g, dtype=torch.float64) * 2 - 0.05
        logp = (old + spread * torch.randn(4, 6, generator=g, dtype=torch.float64)).requires_grad_(True)
        adv = torch.randn(4, 6, generator=g, dtype=torch.float64)
        if peer == "vespo":
            adv = adv[:, :1].expand(4, 6).clone()
        loss = _call(peer, fn, old, logp, adv, mask, params)
        (grad,) = torch.autograd.grad(loss, logp)
        cases.append(
            {
                "params": params,
                "logp": logp.detach().tolist(),
                "old_logp": old.tolist(),
                "advantages": adv.tolist(),
                "loss": loss.item(),
                "grad": grad.tolist(),
            }
        )
    data = {"source": spec["source"], "commit": commit, "function": spec["function"], "mask": MASK, "cases": cases}
    _write(spec["out"], data)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
