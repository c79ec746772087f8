"""Issue 27: a checkpoint written at ep=2 (2 ranks, torchrun over gloo) resumes at ep=1 (1 rank).

From the committed records (``train.rollouts_from``, no server) with the reference policy on
(``loss.kl_coef > 0``): the run trains 2 steps at ep=2, saving every step; its step-2 checkpoint is
set aside and ``latest`` rolled back, as if the job had died right after step 1; the same command
with ``parallel.ep=1`` on 1 rank resumes it (the run-dir rules allow the layout change). Then:

* it is the same run: same run id, the reference and its completion marker untouched;
* the resumed step 2 logs the same metrics as the uninterrupted ep=2 step 2 (the dp/ep equality
  tests' tolerance: only float summation orders differ), and its weights and Adam moments after the
  step match the uninterrupted run's;
* loading step 1 at ep=1 gives exactly the saved global model and Adam state, and the reference
  policy loads at ep=1 as the initial weights, imported independently from the HF dir it started from.

That the ep=2 save gathers each rank's own shard to the right global names is checked against the
ranks' local tensors in ``tests/distributed/ep_parity_worker.py``.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from moe_rl.config import load_config
from moe_rl.learner.checkpoint import load_checkpoint
from moe_rl.learner.dist import init_distributed
from moe_rl.learner.global_state import param_state
from moe_rl.learner.hf_import import load_hf_weights
from moe_rl.learner.model import build_model
from moe_rl.learner.reference import ReferencePolicy
from moe_rl.learner.sharded_state import read_global
from moe_rl.learner.train_step import Learner
from moe_rl.train.metrics_log import read_metrics
from tests.conftest import one_gpu_per_rank
from tests.train.records_fixture import CONFIG, SHAPE, initial_hf_dir
from tests.train.test_step_equality import assert_same_steps, run

pytestmark = pytest.mark.distributed
RUN = ("loss.kl_coef=0.01", "checkpoint.save_interval=1", "train.micro_batch_size=2")


@pytest.fixture(scope="module")
def resharded(tmp_path_factory):
    """(run dir resumed at ep=1, the ep=2 run's metrics, its step-2 checkpoint, the initial HF dir)."""
    work = tmp_path_factory.mktemp("reshard")
    hf = initial_hf_dir(work / "hf")
    out = work / "run"
    uninterrupted = run(out, hf, *RUN, "parallel.ep=2", nproc=2)
    ckpt = out / "checkpoints"
    shutil.move(ckpt / "step_00000002", work / "ep2_step2")  # the job "died" after step 1's checkpoint
    (ckpt / "latest").write_text("1\n")
    identity = {f: (out / f).read_bytes() for f in ("run_id", "checkpoints/reference/complete.json")}
    run(out, hf, *RUN, "parallel.ep=1", nproc=1)  # the same command, one rank, ep=1: resumes at step 1
    assert identity == {f: (out / f).read_bytes() for f in identity}, "the resume is another run, or rewrote π_ref"
    return out, uninterrupted, work / "ep2_step2", hf


@one_gpu_per_rank(2)
def test_ep2_checkpoint_resumes_at_ep1_and_continues_the_same_run(resharded):
    out, uninterrupted, ep2_step2, _ = resharded
    resumed = read_metrics(out / "metrics.jsonl")  # step 1 from the ep=2 run, step 2 from the ep=1 resume
    assert_same_steps(uninterrupted, resumed, "ep=2 -> ep=1 resume")
    assert resumed[1]["loss/kl_ref"] > 0
    meta = json.loads((out / "checkpoints" / "step_00000002" / "meta.json").read_text())
    assert meta["parallel"]["ep"] == 1 and meta["world_size"] == 1 and meta["extra"]["rl_step"] == 2
    assert json.loads((out / "checkpoints" / "step_00000001" / "meta.json").read_text())["parallel"]["ep"] == 2
    run_id = (out / "run_id").read_text().strip()  # both saves (2 ranks, then 1) bound to the run (issue 57)
    assert (
        meta["run_id"]
        == run_id
        == json.loads((out / "checkpoints" / "step_00000001" / "meta.json").read_text())["run_id"]
    )
    for name in ("model", "optimizer"):  # the state after step 2, either way
        want, got = read_global(ep2_step2, name), read_global(out / "checkpoints" / "step_00000002", name)
        assert sorted(want) == sorted(got)
        for k in want:
            torch.testing.assert_close(
                got[k], want[k], rtol=1e-5, atol=2e-6, msg=lambda m, k=k, name=name: f"{name} {k}: {m}"
            )


@one_gpu_per_rank(2)
def test_resumed_state_equals_the_saved_global_state_and_the_reference_its_start(resharded):
    out, _, _, hf = resharded
    cfg = load_config(CONFIG, [*SHAPE, *RUN, "parallel.ep=1", f"checkpoint.init_from_hf={hf}"])
    init_distributed(cfg.parallel, environ={})
    learner = Learner(cfg, model=build_model(cfg, seed=99))  # other weights: everything must come from the files
    step1 = out / "checkpoints" / "step_00000001"
    meta = load_checkpoint(learner, out / "checkpoints", step=1)
    assert meta["resharded_from"]["ep"] == 2 and learner.step == 2  # 2 minibatches per RL step
    model, optim = read_global(step1, "model"), read_global(step1, "optimizer")
    params = dict(learner.module.named_parameters())
    assert sorted(params) == sorted(model), "ep=1 names are the global names"
    for name, p in params.items():
        assert torch.equal(p.detach().cpu(), model[name]), name
        state = param_state(learner.optimizer, p)
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state[key].cpu(), optim[f"{key}/{name}"]), f"{key} of {name}"
        assert float(state["step"]) == float(optim[f"step/{name}"]) == 2.0
    assert float(optim["exp_avg_sq/decoder.layers.0.mlp.experts.local_experts.7.linear_fc1.weight"].abs().max()) > 0

    reference = ReferencePolicy.load(cfg, out / "checkpoints")
    start = build_model(cfg, seed=5)
    load_hf_weights(start, hf, cfg.model)  # π_ref is the weights the run started from
    want = dict(start.named_parameters())
    for name, p in reference.model.named_parameters():
        assert torch.equal(p.detach().cpu(), want[name].detach().cpu()), f"reference {name}"
