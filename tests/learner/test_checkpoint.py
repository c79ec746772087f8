"""Checkpoint save / resume: exact next step, atomic visibility, pruning."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moe_rl.learner.checkpoint import CheckpointError, latest_step, load_checkpoint, save_checkpoint
from moe_rl.learner.global_state import param_state
from moe_rl.learner.model import build_model
from moe_rl.learner.rng_streams import rng_state
from moe_rl.learner.state_codec import StateCodecError, load_state, save_state
from moe_rl.learner.train_step import Learner
from tests.learner.conftest import make_cfg
from tests.learner.test_train_step import fixed_batch


def random_subset_nll(logp, entropy, mb):
    """NLL over a random half of the tokens: the step consumes the torch RNG, so resume must restore it."""
    keep = (torch.rand(logp.shape, device=logp.device) < 0.5).float() * (mb["targets"] >= 0).float()
    return -(logp * keep).sum() / keep.sum().clamp_min(1), {}


def _cfg():
    return make_cfg(
        optim={"lr": 3e-3, "lr_warmup_steps": 2, "lr_decay_style": "cosine", "weight_decay": 0.01},
        moe_aux_loss_coeff=1e-2,
    )


def test_resume_reproduces_next_step_exactly(megatron_world, tmp_path):
    batches = [fixed_batch(256, seed=s) for s in range(3)]
    a = Learner(_cfg(), total_steps=6)
    a.train_step([batches[0]], random_subset_nll)
    a.train_step([batches[1]], random_subset_nll)
    save_checkpoint(a, tmp_path)
    want = a.train_step([batches[2]], random_subset_nll)
    want_params = {n: p.detach().clone() for n, p in a.module.named_parameters()}

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

    a = Learner(_cfg(), total_steps=6)
    a.train_step([fixed_batch(256)], random_subset_nll)
    save_checkpoint(a, tmp_path)
    want = a.train_step([fixed_batch(256, seed=1)], random_subset_nll)
    b = Learner(_cfg(), total_steps=6)
    load_checkpoint(b, tmp_path)
    torch.manual_seed(999)  # clobber the restored RNG
    assert b.train_step([fixed_batch(256, seed=1)], random_subset_nll).loss != want.loss


def test_latest_only_moves_to_complete_checkpoints_and_old_ones_are_pruned(megatron_world, tmp_path):
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


def test_a_format_2_checkpoint_loads_only_on_the_world_size_that_wrote_it(megatron_world, tmp_path):
    learner = Learner(_cfg(), total_steps=2)
    d = tmp_path / "step_00000001"
    d.mkdir()
    save_state(
        {
            "step": 1,
            "optimizer_step": 1,
            "model": learner.module.state_dict(),
            "optimizer": learner.optimizer.state_dict(),
            "rng": rng_now(),
        },
        d / "rank_00000.safetensors",
    )
    meta = {"format_version": 2, "step": 1, "optimizer_step": 1, "world_size": 1, "parallel": {}, "extra": {}}
    (d / "meta.json").write_text(json.dumps(meta))
    assert load_checkpoint(Learner(_cfg(), total_steps=2), tmp_path)["step"] == 1  # older runs still resume
    (d / "meta.json").write_text(json.dumps(meta | {"world_size": 2}))
    with pytest.raises(ValueError, match="format-2 checkpoint saved by 2 ranks"):
        load_checkpoint(learner, tmp_path)


def rng_now():
    return rng_state()


# --------------------------------------------------------------------------- issue 16: safe checkpoints
class _RunsCode:
    """What an attacker pickles into a shard: unpickling it runs a shell command."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_checkpoint_holds_no_pickle_and_a_pickle_shard_is_refused(megatron_world, tmp_path):
    learner = Learner(_cfg(), total_steps=4)
    learner.train_step([fixed_batch(256)], random_subset_nll)
    d = save_checkpoint(learner, tmp_path, extra={"rl_step": 1})
    files = sorted(p.name for p in d.iterdir())
    assert files == [
        "meta.json",
        "model-r00000.safetensors",
        "optimizer-r00000.safetensors",
        "rank_00000.safetensors",
    ], files
    with safe_open(str(d / "rank_00000.safetensors"), framework="pt") as fh:  # tensors + JSON, nothing else
        skeleton = json.loads(fh.metadata()["moe_rl_state"])
    assert set(skeleton["rng"]) >= {"python", "numpy", "torch_cpu", "megatron_tracker"}

    # the probe: a crafted rank_00000.pt in a newer step dir
    marker = tmp_path / "pwned"
    evil = tmp_path / "step_00000009"
    evil.mkdir()
    torch.save({"model": _RunsCode(marker)}, evil / "rank_00000.pt")
    (evil / "meta.json").write_text(json.dumps({"format_version": 1, "step": 9, "world_size": 1, "parallel": {}}))
    (tmp_path / "latest").write_text("9\n")
    with pytest.raises(CheckpointError, match="pickle checkpoint.*refuses to unpickle"):
        load_checkpoint(Learner(_cfg(), total_steps=4), tmp_path)
    assert not marker.exists(), "loading a checkpoint ran the attacker's command"


def test_a_save_killed_mid_write_leaves_the_previous_checkpoint_loadable(megatron_world, tmp_path):
    worker = Path(__file__).with_name("killed_save_worker.py")
    proc = subprocess.run(
        [sys.executable, str(worker), str(tmp_path)], capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == -9, f"the save was not killed mid-write (rc={proc.returncode}):\n{proc.stderr[-2000:]}"
    assert (tmp_path / ".step_00000002.tmp" / "model-r00000.safetensors").is_file(), "killed before the torn write"
    assert latest_step(tmp_path) == 1 and [d.name for d in tmp_path.glob("step_*")] == ["step_00000001"]
    assert load_checkpoint(Learner(_cfg(), total_steps=4), tmp_path)["step"] == 1


def test_state_with_a_non_tensor_object_is_refused_at_save(tmp_path):
    with pytest.raises(StateCodecError, match=r"state.optimizer\[0\] is a .*_RunsCode"):
        save_state({"optimizer": [_RunsCode(tmp_path / "x")]}, tmp_path / "s.safetensors")
    assert not (tmp_path / "s.safetensors").exists()


@pytest.mark.parametrize("torn", ["rank_00000.safetensors", "model-r00000.safetensors", "optimizer-r00000.safetensors"])
def test_corrupt_latest_checkpoint_falls_back_to_the_newest_valid_one(megatron_world, tmp_path, caplog, torn):
    learner = Learner(_cfg(), total_steps=6)
    for rl_step in (1, 2):
        learner.train_step([fixed_batch(256, seed=rl_step)], random_subset_nll)
        save_checkpoint(learner, tmp_path, keep_last=2, extra={"rl_step": rl_step}, step=rl_step)
    assert sorted(d.name for d in tmp_path.glob("step_*")) == ["step_00000001", "step_00000002"]  # named by RL step
    shard = tmp_path / "step_00000002" / torn
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # torn by a full disk / crash
    with caplog.at_level("WARNING"):
        meta = load_checkpoint(Learner(_cfg(), total_steps=6), tmp_path)
    assert meta["extra"]["rl_step"] == 1
    assert "step_00000002" in caplog.text and "resuming from" in caplog.text and "step_00000001" in caplog.text


def _full_filesystem(path):
    """A 64 KiB tmpfs at ``path`` (root only): writes past it fail with ENOSPC."""

    path.mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(path)], check=False).returncode
    ):
        pytest.skip("mounting a tiny tmpfs needs root")
    return path


def test_disk_full_error_names_the_path_and_what_was_written(megatron_world, tmp_path):
    small = _full_filesystem(tmp_path / "small")
    try:
        with pytest.raises(
            CheckpointError,
            match=r"cannot write rank 0's model weights to .*small/ckpt/\.step_\d+\.tmp/model-r00000\.safetensors: the disk is full \(ENOSPC\)",
        ):
            save_checkpoint(Learner(_cfg(), total_steps=2), small / "ckpt")
        assert not list((small / "ckpt").glob(".step_*")), "the torn temp dir was left behind"
    finally:
        subprocess.run(["umount", str(small)], check=False)


# --------------------------------------------------------------------------- issue 27: layout-free checkpoints
@pytest.fixture
def no_pickle(monkeypatch):
    """Any unpickling while the fixture is active fails the test (checkpoint loading must never need it)."""

    def refuse(*args, **kwargs):
        raise AssertionError("checkpoint loading called pickle / torch.load")

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    monkeypatch.setattr(torch, "load", refuse)


def _reindex(path, chunks: str) -> None:
    """Rewrite a rank file with its tensors unchanged and ``chunks`` as its chunk index."""

    with safe_open(str(path), framework="pt") as fh:
        tensors, meta = {k: fh.get_tensor(k) for k in fh.keys()}, dict(fh.metadata())  # noqa: SIM118 - not iterable
    save_file(tensors, str(path), metadata={**meta, "chunks": chunks})


def test_a_crafted_checkpoint_is_refused_without_running_code(megatron_world, tmp_path, no_pickle):
    learner = Learner(_cfg(), total_steps=4)
    learner.train_step([fixed_batch(256)], random_subset_nll)
    good = save_checkpoint(learner, tmp_path, extra={"rl_step": 1}, step=1)
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_RunsCode(marker))
    # a dist_checkpointing (torch_dist) style step dir: the pickled ``.metadata`` carries the payload
    evil = tmp_path / "step_00000002"
    shutil.copytree(good, evil)
    (evil / ".metadata").write_bytes(payload)
    (evil / "common.pt").write_bytes(payload)
    (tmp_path / "latest").write_text("2\n")
    with pytest.raises(CheckpointError, match=r"\.metadata is a pickle checkpoint file.*refuses to unpickle"):
        load_checkpoint(Learner(_cfg(), total_steps=4), tmp_path)
    assert not marker.exists(), "loading a checkpoint ran the attacker's command"
    # format 4's tensor files: a rank file that is a pickle, and one whose chunk index is pickle bytes, are
    # unreadable (safetensors header / JSON), so the newest checkpoint is skipped, nothing executed
    shutil.rmtree(evil)
    for victim, forge in (
        ("model-r00000.safetensors", lambda f: f.write_bytes(payload)),
        ("optimizer-r00000.safetensors", lambda f: _reindex(f, payload.hex())),
    ):
        shutil.copytree(good, evil)
        forge(evil / victim)
        assert load_checkpoint(Learner(_cfg(), total_steps=4), tmp_path)["step"] == 1, victim
        assert not marker.exists(), "loading a checkpoint ran the attacker's command"
        shutil.rmtree(evil)
    # pickle bytes smuggled into the metadata of the safetensors files and meta.json stay inert data: the
    # rewritten file fails its checksums (format 5), and without them (format 4) it loads as data
    state = load_state(good / "rank_00000.safetensors")
    save_state({**state, "rng": {**state["rng"], "evil": payload}}, good / "rank_00000.safetensors")
    with pytest.raises(CheckpointError, match=r"rank_00000\.safetensors carries no run id / step in its header"):
        load_checkpoint(Learner(_cfg(), total_steps=4), tmp_path)
    meta = json.loads((good / "meta.json").read_text())
    meta = {**meta, "format_version": 4, "extra": {**meta["extra"], "evil": payload.hex()}}
    (good / "meta.json").write_text(json.dumps(meta))
    assert load_checkpoint(Learner(_cfg(), total_steps=4), tmp_path)["step"] == 1
    assert not marker.exists()


def test_a_checkpoint_from_another_layout_loads_its_global_state(megatron_world, tmp_path, caplog):
    """World 1 cannot run another layout; the meta says the checkpoint came from ep=2 on 2 ranks (the
    2-rank reshard is tests/train/test_reshard_resume.py): the global files load, the change is logged."""

    a = Learner(_cfg(), total_steps=6)
    a.train_step([fixed_batch(256)], random_subset_nll)
    d = save_checkpoint(a, tmp_path, extra={"rl_step": 1})
    meta = json.loads((d / "meta.json").read_text())
    meta |= {"world_size": 2, "parallel": {**meta["parallel"], "ep": 2, "dp": 2}}
    (d / "meta.json").write_text(json.dumps(meta))
    b = Learner(_cfg(), total_steps=6, model=build_model(_cfg(), seed=5))
    with caplog.at_level("WARNING"):
        got = load_checkpoint(b, tmp_path)
    assert got["resharded_from"]["ep"] == 2 and b.step == 1
    assert "resharded checkpoint" in caplog.text and "'ep': 2" in caplog.text
    for (n, p), q in zip(a.module.named_parameters(), b.module.parameters(), strict=True):
        assert torch.equal(p, q), n
        sa, sb = param_state(a.optimizer, p), param_state(b.optimizer, q)
        assert all(torch.equal(sa[k].cpu(), sb[k].cpu()) for k in ("exp_avg", "exp_avg_sq", "step")), n


def test_a_checkpoint_of_another_model_shape_fails_naming_the_tensor(megatron_world, tmp_path):
    save_checkpoint(Learner(_cfg(), total_steps=2), tmp_path)
    other = make_cfg(moe_ffn_hidden_size=16)
    with pytest.raises(
        CheckpointError,
        match=r"size mismatch for .*experts.local_experts.0.linear_fc1.weight: "
        r"saved \(64, 64\), the model expects \(32, 64\).*model\.\*",
    ):
        load_checkpoint(Learner(other, total_steps=2), tmp_path)
