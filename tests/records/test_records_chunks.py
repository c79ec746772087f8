"""Issue 52 item 4: records per rank. A data-parallel rank reads only its share of a step's records (format 3),
every chunk checked against its digest; format-2 files (the committed one was written by the code before
format 3, from the same SGLang records as ``tests/data/records_tiny_cpu/step_000000``) still read, whole."""

from __future__ import annotations

import hashlib
import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from moe_rl.cli import main
from moe_rl.config import load_config
from moe_rl.records import RecordError, RolloutBatch
from moe_rl.records.chunks import RecordsFile
from moe_rl.records.share import load_share
from moe_rl.train.batching import build_microbatch, kept_set_outside_fraction
from moe_rl.train.plan import plan_step
from tests.train.records_fixture import CONFIG, RECORDS, ROOT, SHAPE

STEP0 = RECORDS / "step_000000.safetensors"
FORMAT2 = ROOT / "tests/data/records_format2/step_000000.safetensors"
KSM_SHARED = ("sampling_logp", "token_versions")  # what the tiny_cpu trainer reads on every rank (Keep Sampling Mask)


def _share(step: int, rank: int, dp: int = 2) -> tuple[int, ...]:
    """Rank ``rank``'s samples of ``step`` as the step-equality runs plan them (tiny_cpu with SHAPE)."""
    t = load_config(CONFIG, SHAPE).train
    mb = t.minibatches_per_step
    return plan_step(16, minibatches=mb, micro_batch_size=2, dp_rank=rank, dp_size=dp, seed=t.seed, step=step).owned_ids


def _same_sample(a, b) -> None:
    for name in ("prompt_ids", "response_ids", "routes", "sampling_logp"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    assert len(a.sampling_mask) == len(b.sampling_mask)
    assert all(np.array_equal(x, y) for x, y in zip(a.sampling_mask, b.sampling_mask))
    assert (a.reward, a.group_id, a.finish_reason) == (b.reward, b.group_id, b.finish_reason)


@pytest.mark.parametrize("step", [0, 1])
def test_each_rank_reads_its_share_and_at_most_0_6_of_the_file(step):
    path = RECORDS / f"step_00000{step}.safetensors"
    whole = RolloutBatch.load(path)
    seen = []
    for rank in range(2):
        ids = _share(step, rank)
        read = load_share(path, ids, num_samples=16, shared=KSM_SHARED)
        assert read.file_bytes == path.stat().st_size
        assert read.bytes_read <= 0.6 * read.file_bytes, (rank, read.bytes_read, read.file_bytes)
        assert read.batch.rollout_logp is None and len(read.batch) == 16 and read.batch.sha256 == whole.sha256
        for i in ids:
            _same_sample(read.batch.sample(i), whole.sample(i))
        other = next(i for i in range(16) if i not in ids)
        with pytest.raises(RecordError, match=f"sample {other} is not among the samples this batch holds"):
            read.batch.sample(other)
        seen += ids
    assert sorted(seen) == list(range(16))  # every sample's chunk is read (and checked) by some rank
    assert load_share(path).bytes_read >= path.stat().st_size  # no share: every byte


def _tampered(tmp_path, array: str, row: int):
    """A copy of step 0 with one byte of ``array``'s row ``row`` changed."""
    path = shutil.copyfile(STEP0, tmp_path / "step_000000.safetensors")
    with RecordsFile(path) as f:
        dtype, shape, at = f._tensors[array]
    at += row * int(np.prod(shape[1:])) * dtype.itemsize
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))
    return path


def test_a_tampered_chunk_is_refused_naming_the_file_and_the_chunk(tmp_path, capsys):
    whole = RolloutBatch.load(STEP0)
    i = 5  # sample 5's first route row
    path = _tampered(tmp_path, "routes", int(whole.route_lens[:i].sum()))
    line = (
        f"{path}: chunk 'sample {i}' has sha256 [0-9a-f]{{32}}, the file's index says [0-9a-f]{{32}}: the chunk changed"
    )
    with pytest.raises(RecordError, match=line) as info:
        load_share(path, [3, i])
    assert "\n" not in str(info.value)
    with pytest.raises(RecordError, match=line):
        RolloutBatch.load(path)
    assert main(["records", "inspect", str(path)]) == 2
    assert capsys.readouterr().err.startswith(f"error: {path}: chunk 'sample {i}' has sha256")
    assert len(load_share(path, [3, 4]).batch) == 16  # a share without sample 5 never reads its bytes
    for array, chunk in (("sampling_logp", "sampling_logp"), ("response_lens", "samples")):
        with pytest.raises(RecordError, match=f"{tmp_path}/t.safetensors: chunk '{chunk}' has sha256"):
            load_share(shutil.copyfile(_tampered(tmp_path, array, 0), tmp_path / "t.safetensors"), [0])
    data = STEP0.read_bytes().replace(b'\\"stop\\"', b'\\"stoq\\"', 1)  # a finish reason edited in the metadata
    (tmp_path / "meta.safetensors").write_bytes(data)
    with pytest.raises(RecordError, match="meta.safetensors: chunk 'meta' has sha256"):
        load_share(tmp_path / "meta.safetensors", [0])


def test_format_2_records_still_read_and_inspect(capsys):
    assert main(["records", "inspect", str(FORMAT2)]) == 0
    assert json.loads(capsys.readouterr().out)["format_version"] == 2
    old, new = RolloutBatch.load(FORMAT2), RolloutBatch.load(STEP0)
    assert (old.format_version, new.format_version) == (2, 3)
    assert old.sha256 == hashlib.sha256(FORMAT2.read_bytes()).hexdigest()  # formats 1-2: the whole file's digest
    read = load_share(FORMAT2, _share(0, 0), num_samples=16, shared=KSM_SHARED)  # no chunk digests: read whole
    assert read.batch.held is None and read.bytes_read >= FORMAT2.stat().st_size and read.batch.sha256 == old.sha256
    for i in range(16):
        _same_sample(read.batch.sample(i), new.sample(i))
    with pytest.raises(RecordError, match=r"has 16 samples; the config asks for 32 \(train.prompts_per_step"):
        load_share(FORMAT2, num_samples=32)
    with pytest.raises(RecordError, match=r"has 16 samples; the config asks for 32 \(train.prompts_per_step"):
        load_share(STEP0, [0], num_samples=32)


def test_a_shares_microbatches_are_the_whole_files(device):
    """What the learner builds from a rank's share (ids, targets, μ, kept sets, routes) is what it builds from
    the whole file for those samples."""
    whole = RolloutBatch.load(STEP0)
    ids = _share(1, 1)
    share = load_share(STEP0, ids, shared=KSM_SHARED).batch
    adv = torch.arange(16, dtype=torch.float32)
    for group in (ids[:2], ids[2:5], ids[::-1]):
        a, b = (
            build_microbatch(x, group, adv, num_experts=8, kept_logp=True, with_kept_sets=True, device=device)
            for x in (whole, share)
        )
        for key in ("input_ids", "targets", "mask", "rollout_logp", "advantages"):
            assert torch.equal(a.tensors[key], b.tensors[key]), key
        assert torch.equal(a.tensors["kept"].ids, b.tensors["kept"].ids)
        assert torch.equal(a.tensors["kept"].offsets, b.tensors["kept"].offsets)
        assert torch.equal(a.routes.rollout, b.routes.rollout)
    assert kept_set_outside_fraction(share) == kept_set_outside_fraction(load_share(STEP0, ids).batch)


def test_format_3_metadata_without_its_chunk_index_is_refused(tmp_path):
    data = STEP0.read_bytes()
    size = int.from_bytes(data[:8], "little")
    meta = json.loads(json.loads(data[8 : 8 + size])["__metadata__"]["moe_rl"])
    del meta["chunks"]
    path = tmp_path / "no_index.safetensors"
    save_file(load_file(str(STEP0)), str(path), metadata={"moe_rl": json.dumps(meta)})
    for load in (lambda: load_share(path, [0]), lambda: RolloutBatch.load(path)):
        with pytest.raises(RecordError, match=f"{path}: format 3 metadata must hold chunks with 'meta', 'shared'"):
            load()
