"""Issue 57, item 2: checkpoint files bound to their save (run id + step in every header, sha256 in meta.json).

A shard of another run with the same shapes, and 4 flipped bytes near the end of a shard's tensor data,
each make the newest checkpoint damaged: the load falls back to the previous one with one warning naming
the file and what differed. A checkpoint of the previous format (no checksums) still loads, with one warning.
The 2-rank case (rank 1 finds its file damaged, both ranks fall back) is in tests/distributed/distopt_worker.py.
"""

from __future__ import annotations

import hashlib
import json
import shutil

import torch
from safetensors import safe_open

from moe_rl.learner import checksums
from moe_rl.learner.checkpoint import load_checkpoint, save_checkpoint
from moe_rl.learner.model import build_model
from moe_rl.learner.train_step import Learner
from tests.learner.test_checkpoint import _cfg, random_subset_nll
from tests.learner.test_train_step import fixed_batch

RUN, OTHER = "run00000000a", "run00000000b"


def _two_saves(ckpt, run_id: str, device, seed: int = 7) -> dict[int, dict]:
    """Steps 1 and 2 of a run saved under ``ckpt``; the weights after each."""

    learner = Learner(_cfg(), total_steps=4, model=build_model(_cfg(), seed=seed))
    weights = {}
    for rl_step in (1, 2):
        learner.train_step([fixed_batch(256, seed=rl_step, device=device)], random_subset_nll)
        save_checkpoint(learner, ckpt, extra={"rl_step": rl_step}, step=rl_step, run_id=run_id)
        weights[rl_step] = {n: p.detach().clone() for n, p in learner.module.named_parameters()}
    return weights


def _resume(ckpt, caplog) -> tuple[dict, Learner, list[str]]:
    lrn = Learner(_cfg(), total_steps=4, model=build_model(_cfg(), seed=99))
    caplog.clear()
    with caplog.at_level("WARNING", logger="moe_rl.learner.checkpoint"):
        meta = load_checkpoint(lrn, ckpt)
    return meta, lrn, [r.getMessage() for r in caplog.records if r.name == "moe_rl.learner.checkpoint"]


def _assert_weights(lrn: Learner, want: dict) -> None:
    for n, p in lrn.module.named_parameters():
        assert torch.equal(p.detach(), want[n]), f"{n} is not the fallback checkpoint's"


def test_every_file_carries_the_run_and_step_and_meta_json_its_checksums(megatron_world, tmp_path, device, caplog):
    _two_saves(tmp_path, RUN, device)
    learner = Learner(_cfg(), total_steps=4)
    (tmp_path / "records.bin").write_bytes(b"finished but untrained records")
    save_checkpoint(learner, tmp_path, step=3, run_id=RUN, files={"records.bin": tmp_path / "records.bin"})
    d = tmp_path / "step_00000003"
    meta = json.loads((d / "meta.json").read_text())
    assert meta["format_version"] == 5 and meta["run_id"] == RUN and meta["step"] == 3
    table = meta["checksums"]
    assert table["algorithm"] == "sha256" and table["chunk_bytes"] == 64 << 20
    names = ["model-r00000.safetensors", "optimizer-r00000.safetensors", "rank_00000.safetensors"]
    assert sorted(table["files"]) == ["files/records.bin", *names]
    for name in names:
        header = safe_open(str(d / name), framework="pt").metadata()
        assert (header["run_id"], header["step"]) == (RUN, "3"), name
        record = table["files"][name]
        data = (d / name).read_bytes()
        assert record["bytes"] == len(data) and len(record["chunks"]) == 1
        assert record["chunks"] == [hashlib.sha256(data).hexdigest()]  # one chunk: the file's plain sha256
        assert record["sha256"] == hashlib.sha256(bytes.fromhex(record["chunks"][0])).hexdigest()
    # a carried file (the async producer's records) is checked too, by rank 0
    (d / "files" / "records.bin").write_bytes(b"finished but untrained recordz")
    meta, _, warnings = _resume(tmp_path, caplog)
    assert meta["step"] == 2 and len(warnings) == 1 and "files/records.bin: chunk 0 (bytes 0-29 of 30)" in warnings[0]


def test_a_shard_of_another_run_is_refused_and_the_previous_checkpoint_loads(megatron_world, tmp_path, device, caplog):
    ours = _two_saves(tmp_path / "ours", RUN, device)
    _two_saves(tmp_path / "other", OTHER, device, seed=11)  # another run of the same model: same shapes
    victim = tmp_path / "ours" / "step_00000002" / "model-r00000.safetensors"
    shutil.copyfile(tmp_path / "other" / "step_00000002" / "model-r00000.safetensors", victim)
    meta, lrn, warnings = _resume(tmp_path / "ours", caplog)
    assert meta["step"] == 1 and lrn.step == 1
    _assert_weights(lrn, ours[1])
    assert len(warnings) == 1, warnings
    assert "resuming from" in warnings[0] and "step_00000001" in warnings[0]
    assert f"{victim} was written by run {OTHER!r} at step 2, but meta.json names run {RUN!r}" in warnings[0]


def test_flipped_bytes_in_tensor_data_are_refused_naming_the_chunk(
    megatron_world, tmp_path, device, caplog, monkeypatch
):
    monkeypatch.setattr(checksums, "CHUNK_BYTES", 64 << 10)  # several chunks in a tiny model's file
    ours = _two_saves(tmp_path, RUN, device)
    victim = tmp_path / "step_00000002" / "model-r00000.safetensors"
    data = bytearray(victim.read_bytes())
    at = len(data) - 37  # near the end of the last tensor's data
    data[at : at + 4] = bytes(b ^ 0xFF for b in data[at : at + 4])
    victim.write_bytes(bytes(data))
    last = (len(data) - 1) // (64 << 10)
    assert last >= 2, "the file should span several chunks"
    meta, lrn, warnings = _resume(tmp_path, caplog)
    assert meta["step"] == 1
    _assert_weights(lrn, ours[1])
    assert len(warnings) == 1, warnings
    assert f"{victim}: chunk {last} (bytes {last * (64 << 10)}-{len(data) - 1} of {len(data)})" in warnings[0]
    assert "has another sha256 than meta.json recorded" in warnings[0]


def test_a_checkpoint_without_checksums_loads_with_one_warning(megatron_world, tmp_path, device, caplog):
    ours = _two_saves(tmp_path, RUN, device)
    for step in (1, 2):  # as the previous release (format 4) wrote them: no run id, no checksums
        path = tmp_path / f"step_{step:08d}" / "meta.json"
        meta = json.loads(path.read_text())
        del meta["checksums"], meta["run_id"]
        path.write_text(json.dumps(meta | {"format_version": 4}))
    meta, lrn, warnings = _resume(tmp_path, caplog)
    assert meta["step"] == 2 and meta["format_version"] == 4
    _assert_weights(lrn, ours[2])
    assert len(warnings) == 1 and "format-4 checkpoint" in warnings[0] and "no checksums" in warnings[0], warnings
