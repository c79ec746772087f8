"""Issue 16, item 7: unreadable records files give one line naming the file; structure is checked without a model."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from moe_rl.cli import main
from moe_rl.records import RecordError, RolloutBatch, RolloutSample
from moe_rl.records.batch_checks import LOGPROB_TOLERANCE
from moe_rl.records.sglang_meta import _checked_logprobs


def _batch(device) -> RolloutBatch:
    """2 samples (P=3, R=2 and P=2, R=3), routes [P+R-1, 2 layers, top-2] over 8 experts, kept sets."""

    gen = torch.Generator(device="cpu").manual_seed(0)
    samples = []
    for p, r in ((3, 2), (2, 3)):
        routes = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range((p + r - 1) * 2)]).view(
            p + r - 1, 2, 2
        )
        resp = torch.randint(0, 64, (r,), generator=gen)
        samples.append(
            RolloutSample(
                prompt_ids=torch.randint(0, 64, (p,), generator=gen).to(device).cpu().numpy().astype(np.int32),
                response_ids=resp.numpy().astype(np.int32),
                rollout_logp=-torch.rand(r, generator=gen).numpy().astype(np.float32),
                routes=routes.numpy(),
                sampling_mask=[np.array([int(t), (int(t) + 1) % 64], np.int32) for t in resp],
                weight_version="step-0",
                finish_reason="length",
            )
        )
    return RolloutBatch.from_samples(samples, num_experts=8)


def test_valid_batch_round_trips(device, tmp_path):
    path = _batch(device).save(tmp_path / "ok.safetensors")
    assert len(RolloutBatch.load(path)) == 2
    assert main(["records", "inspect", str(path)]) == 0


def _write_raw(path, batch: RolloutBatch, meta_override=None):
    """Write ``batch`` as-is (no validation), optionally with other metadata."""
    batch.save(path)
    if meta_override is not None:
        save_file(load_file(str(path)), str(path), metadata={"moe_rl": meta_override})
    return path


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda b: setattr(b, "routes", b.routes[:-1]), "routes has 7 rows; expected one per forwarded position.*= 8"),
        (lambda b: b.routes.__setitem__((0, 0, 0), 9), r"expert ids must be in \[0, 8\)"),
        (lambda b: setattr(b, "mask_offsets", np.array([0, 2, 4, 3, 8, 10], np.int64)), "grow by >= 1 per token"),
        (lambda b: setattr(b, "mask_offsets", np.array([0, 2, 2, 6, 8, 10], np.int64)), "size 0"),
        (
            lambda b: setattr(b, "response_ids", b.response_ids.astype(np.float32) + 0.5),
            "response_ids must be a 1-D integer",
        ),
        (lambda b: b.rollout_logp.__setitem__(1, 0.01), r"rollout_logp\[1\] = 0.01"),
        (lambda b: b.rollout_logp.__setitem__(2, np.inf), "rollout_logp has 1 non-finite values"),
        (lambda b: setattr(b, "num_experts", 4), r"expert ids must be in \[0, 4\)|does not match num_experts"),
    ],
    ids=[
        "route_rows",
        "expert_id",
        "mask_offsets_non_monotone",
        "mask_size_zero",
        "float_token_ids",
        "logp_positive",
        "logp_inf",
        "num_experts_too_small",
    ],
)
def test_structural_errors_are_caught_without_a_model(device, tmp_path, mutate, field):
    batch = _batch(device)
    mutate(batch)
    path = _write_raw(tmp_path / "bad.safetensors", batch)
    with pytest.raises(RecordError, match=field) as info:
        RolloutBatch.load(path)
    assert str(path) in str(info.value)


def test_logprob_tolerance_is_the_decoders(device, tmp_path):
    for value, ok in ((LOGPROB_TOLERANCE / 2, True), (LOGPROB_TOLERANCE * 2, False)):
        batch = _batch(device)
        batch.rollout_logp[0] = value
        path = _write_raw(tmp_path / f"t{ok}.safetensors", batch)
        try:
            _checked_logprobs("x", [value])
            decoder_ok = True
        except RecordError:
            decoder_ok = False
        try:
            RolloutBatch.load(path)
            file_ok = True
        except RecordError:
            file_ok = False
        assert decoder_ok == file_ok == ok


def _broken_files(device, tmp_path) -> dict:
    good = _batch(device).save(tmp_path / "good.safetensors")
    raw = good.read_bytes()
    files = {
        "truncated": raw[: len(raw) // 2],
        "empty": b"",
        "random": np.random.default_rng(0).bytes(4096),
    }
    out = {}
    for name, data in files.items():
        (tmp_path / f"{name}.safetensors").write_bytes(data)
        out[name] = tmp_path / f"{name}.safetensors"
    meta = {"format_version": 1, "num_experts": 8, "weight_versions": "oops", "finish_reasons": [], "extra": {}}
    out["bad_meta_types"] = _write_raw(tmp_path / "bad_meta_types.safetensors", _batch(device), json.dumps(meta))
    out["bad_meta_json"] = _write_raw(tmp_path / "bad_meta_json.safetensors", _batch(device), "{not json")
    meta["weight_versions"], meta["num_experts"] = ["a"] * 2, "eight"
    out["bad_num_experts"] = _write_raw(tmp_path / "bad_num_experts.safetensors", _batch(device), json.dumps(meta))
    out["directory"] = tmp_path
    out["missing"] = tmp_path / "missing.safetensors"
    return out


def test_records_inspect_prints_one_line_per_unreadable_file(device, tmp_path, capsys):
    files = _broken_files(device, tmp_path)
    for name, path in files.items():
        rc = main(["records", "inspect", str(path)])
        err = capsys.readouterr().err.strip()
        assert rc == 2, name
        assert len(err.splitlines()) == 1 and err.startswith(f"error: {path}: "), f"{name}: {err!r}"
        assert "Traceback" not in err
