"""The frozen reference policy: the learner's initial weights on the real Megatron-Core model (gloo,
world 1), no gradients, unchanged by learner steps, safetensors round trip, replayed routes."""

from __future__ import annotations

import json

import pytest
import torch

from moe_rl.algo import compute_policy_loss
from moe_rl.config import CorrectionConfig, LossConfig
from moe_rl.learner.dist import init_distributed
from moe_rl.learner.logprobs import response_logprobs
from moe_rl.learner.model import build_model
from moe_rl.learner.reference import ReferencePolicy, reference_path, reference_problem, save_reference
from moe_rl.learner.train_step import Learner
from tests.learner.conftest import make_cfg
from tests.learner.test_train_step import fixed_batch


@pytest.fixture(scope="module")
def megatron_world():
    return init_distributed(make_cfg().parallel, environ={})


def _nll(logp, entropy, mb):
    return -logp.mean(), {}


def _learner_logp(learner, mb):
    with torch.no_grad():
        return response_logprobs(learner.module, mb["input_ids"], mb["targets"], with_entropy=False)[0]


def test_reference_is_the_initial_policy_frozen_and_kl_is_logged(megatron_world, device):
    cfg = make_cfg(optim={"lr": 1e-2})
    learner = Learner(cfg, total_steps=4)
    mb = {k: v.to(device) for k, v in fixed_batch(cfg.model.vocab_size, seed=1).items()}
    torch.manual_seed(123)  # any state other than the one building a model from cfg.train.seed leaves
    rng_before = torch.get_rng_state()
    ref = ReferencePolicy.from_learner(cfg, learner.module, offload=True)
    assert torch.equal(torch.get_rng_state(), rng_before)  # building π_ref draws from no learner stream
    assert not any(p.requires_grad for p in ref.model.parameters())
    initial = _learner_logp(learner, mb)
    torch.testing.assert_close(ref.logprobs(mb), initial, rtol=0, atol=0)
    learner.train_step([mb], _nll)
    learner.train_step([mb], _nll)
    moved = _learner_logp(learner, mb)
    assert (moved - initial).abs().max() > 1e-3  # the learner moved ...
    ref_logp = ref.logprobs(mb)
    torch.testing.assert_close(ref_logp, initial, rtol=0, atol=0)  # ... π_ref did not
    # the loss side: KL to π_ref enters the loss and is logged under a name containing "ref"
    mask = torch.ones_like(moved, dtype=torch.bool)
    logp = moved.clone().double().requires_grad_(True)
    loss_cfg = LossConfig(kl_coef=0.01, kl_estimator="k3")
    _, m = compute_policy_loss(
        loss_cfg,
        CorrectionConfig(),
        logp,
        moved.double(),
        moved.double(),
        torch.zeros(mask.shape[0], dtype=torch.float64, device=device),
        mask,
        ref_logp=ref_logp.double(),
    )
    x = (ref_logp - moved).double()
    assert m["loss/kl_ref"].item() == pytest.approx((torch.expm1(x) - x).mean().item(), rel=1e-6)  # float32 metric


def test_reference_saves_as_safetensors_and_reloads(megatron_world, tmp_path, device):
    cfg = make_cfg()
    learner = Learner(cfg, total_steps=2, model=build_model(cfg, seed=11))
    ref = ReferencePolicy.from_learner(cfg, learner.module)
    path = ref.save(tmp_path)
    assert path == reference_path(tmp_path)
    header = path.read_bytes()[:9]
    assert header[8:9] == b"{"  # safetensors: u64 header length, then JSON — no pickle
    mb = {k: v.to(device) for k, v in fixed_batch(cfg.model.vocab_size, seed=2).items()}
    again = ReferencePolicy.load(cfg, tmp_path)  # built from cfg.train.seed: a different init, then loaded
    torch.testing.assert_close(again.logprobs(mb), ref.logprobs(mb), rtol=0, atol=0)
    with pytest.raises(FileNotFoundError, match="reference"):
        ReferencePolicy.load(cfg, tmp_path / "nowhere")


def test_reference_replays_the_given_routes(megatron_world, device):
    cfg = make_cfg()
    learner = Learner(cfg, total_steps=2)
    ref = ReferencePolicy.from_learner(cfg, learner.module)
    mb = {k: v.to(device) for k, v in fixed_batch(cfg.model.vocab_size, b=2, t=8, seed=3).items()}
    B, S = mb["input_ids"].shape
    g = torch.Generator().manual_seed(0)
    routes = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(B * S * 2)]).view(B, S, 2, 2)
    natural = ref.logprobs(mb)
    replayed = ref.logprobs(mb, routes=routes.to(device))
    assert (replayed - natural).abs().max() > 1e-4  # the given experts were used
    torch.testing.assert_close(ref.logprobs(mb, routes=routes.to(device)), replayed, rtol=0, atol=0)
    ref.close()


def test_reference_lifecycle_marker_run_id_and_interrupted_saves(megatron_world, tmp_path, device):
    """Issue 21 item 3: a reference is this run's only with its completion marker; a stale one (another run,
    an interrupted save) is replaced by the next save and reported, never silently used."""

    cfg = make_cfg()
    learner = Learner(cfg, total_steps=1)
    ref = ReferencePolicy.from_learner(cfg, learner.module)
    ckpt = tmp_path / "ckpt"
    assert "is missing" in reference_problem(ckpt, "run-a")
    # another run's complete reference sits in the directory (e.g. checkpoint.dir reused)
    assert save_reference(ref, ckpt, "run-old")
    assert "belongs to run 'run-old', not this run ('run-a')" in reference_problem(ckpt, "run-a")
    (ckpt / "reference" / "stale.bin").write_text("x")
    assert save_reference(ref, ckpt, "run-a")  # replaced whole, marker last
    assert reference_problem(ckpt, "run-a") is None and not (ckpt / "reference" / "stale.bin").exists()
    assert json.loads((ckpt / "reference" / "complete.json").read_text())["run_id"] == "run-a"
    assert not save_reference(ref, ckpt, "run-a")  # this run's: kept as it is
    # a save interrupted before the marker (files, no marker) and a lost rank file are both reported
    (ckpt / "reference" / "complete.json").unlink()
    assert "is incomplete (no completion marker" in reference_problem(ckpt, "run-a")
    assert save_reference(ref, ckpt, "run-a")
    reference_path(ckpt).unlink()
    assert "lacks its weights file model-r00000.safetensors" in reference_problem(ckpt, "run-a")
