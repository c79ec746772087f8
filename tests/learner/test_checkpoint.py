"""Checkpoint save / resume: exact next step, atomic visibility, pruning."""

from __future__ import annotations

import pytest
import torch

from tests.learner.conftest import make_cfg
from tests.learner.test_train_step import fixed_batch


def random_subset_nll(logp, entropy, mb):
    """NLL over a random half of the tokens: the step consumes the torch RNG, so resume must restore it."""
    keep = (torch.rand(logp.shape, device=logp.device) < 0.5).float() * (mb["targets"] >= 0).float()
    return -(logp * keep).sum() / keep.sum().clamp_min(1), {}


def _cfg():
    return make_cfg(optim={"lr": 3e-3, "lr_warmup_steps": 2, "lr_decay_style": "cosine", "weight_decay": 0.01},
                    moe_aux_loss_coeff=1e-2)


def test_resume_reproduces_next_step_exactly(megatron_world, tmp_path):
    from moe_rl.learner.checkpoint import load_checkpoint, save_checkpoint
    from moe_rl.learner.train_step import Learner

    batches = [fixed_batch(256, seed=s) for s in range(3)]
    a = Learner(_cfg(), total_steps=6)
    a.train_step([batches[0]], random_subset_nll)
    a.train_step([batches[1]], random_subset_nll)
    save_checkpoint(a, tmp_path)
    want = a.train_step([batches[2]], random_subset_nll)
    want_params = {n: p.detach().clone() for n, p in a.module.named_parameters()}

    from moe_rl.learner.model import build_model

    b = Learner(_cfg(), total_steps=6, model=build_model(_cfg(), seed=5))  # other init: weights must load
    torch.manual_seed(12345)  # a resumed process starts from some other RNG state
    meta = load_checkpoint(b, tmp_path)
    assert meta["step"] == 2 and b.step == 2
    got = b.train_step([batches[2]], random_subset_nll)
    assert got.loss == want.loss, f"resumed loss {got.loss!r} != uninterrupted {want.loss!r}"
    assert got.grad_norm == want.grad_norm and got.lr == want.lr
    for n, p in b.module.named_parameters():
        assert torch.equal(p, want_params[n]), f"{n} differs after the resumed step"


def test_resume_without_rng_restore_would_differ(megatron_world, tmp_path):
    """Guards the test above: the loss really depends on the restored RNG state."""
    from moe_rl.learner.checkpoint import load_checkpoint, save_checkpoint
    from moe_rl.learner.train_step import Learner

    a = Learner(_cfg(), total_steps=6)
    a.train_step([fixed_batch(256)], random_subset_nll)
    save_checkpoint(a, tmp_path)
    want = a.train_step([fixed_batch(256, seed=1)], random_subset_nll)
    b = Learner(_cfg(), total_steps=6)
    load_checkpoint(b, tmp_path)
    torch.manual_seed(999)  # clobber the restored RNG
    assert b.train_step([fixed_batch(256, seed=1)], random_subset_nll).loss != want.loss


def test_latest_only_moves_to_complete_checkpoints_and_old_ones_are_pruned(megatron_world, tmp_path):
    from moe_rl.learner.checkpoint import latest_step, load_checkpoint, save_checkpoint
    from moe_rl.learner.train_step import Learner

    learner = Learner(_cfg(), total_steps=6)
    assert load_checkpoint(learner, tmp_path) is None and latest_step(tmp_path) is None
    for _ in range(3):
        learner.train_step([fixed_batch(256)], random_subset_nll)
        save_checkpoint(learner, tmp_path, keep_last=2)
    assert latest_step(tmp_path) == 3
    assert sorted(d.name for d in tmp_path.glob("step_*")) == ["step_00000002", "step_00000003"]
    # A save that died half way leaves only a hidden temp dir; latest still names step 3.
    (tmp_path / ".step_00000004.tmp").mkdir()
    (tmp_path / ".step_00000004.tmp" / "rank_00000.pt").write_bytes(b"truncated")
    assert latest_step(tmp_path) == 3
    assert load_checkpoint(Learner(_cfg(), total_steps=6), tmp_path)["step"] == 3


def test_resume_on_another_world_size_is_refused(megatron_world, tmp_path):
    import json

    from moe_rl.learner.checkpoint import load_checkpoint, save_checkpoint
    from moe_rl.learner.train_step import Learner

    learner = Learner(_cfg(), total_steps=2)
    d = save_checkpoint(learner, tmp_path)
    meta = json.loads((d / "meta.json").read_text())
    meta["world_size"] = 2
    (d / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="saved by 2 ranks"):
        load_checkpoint(learner, tmp_path)
