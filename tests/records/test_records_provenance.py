"""Issue 28: records carry their producer's architecture fingerprint and run id, and every load that
will be trained on is checked against the learner's model (one line naming the key), the same bytes
on every rank (the 2-rank case: ``tests/train/test_step_records_ranks.py``)."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil

import numpy as np
import pytest

from moe_rl.cli import main
from moe_rl.config import ModelConfig, load_config
from moe_rl.records import RecordError, RolloutBatch, RolloutSample
from moe_rl.records.fingerprint import ARCHITECTURE_FIELDS, TRAINING_ONLY_FIELDS, architecture_fingerprint
from moe_rl.source.step_records import StepRecords
from moe_rl.tasks.tokenizer import task_vocab
from tests.train.records_fixture import CONFIG, RECORDS, SHAPE

MODEL = ModelConfig(num_layers=2, num_moe_experts=8, moe_router_topk=2, vocab_size=64, hidden_size=64)
SOURCE = "train.rollouts_from=DIR"


def _records(tmp_path, run_id="producer0001", model=MODEL, name="step_000000.safetensors", seed=0):
    """3 samples with routes over ``model``'s experts, stamped by a learner with ``model`` and run ``run_id``."""
    rng = np.random.default_rng(seed)
    k, layers = model.moe_router_topk, model.num_moe_layers
    samples = []
    for p, r in ((3, 2), (2, 3), (4, 1)):
        routes = np.stack([rng.permutation(model.num_moe_experts)[:k] for _ in range((p + r - 1) * layers)])
        samples.append(
            RolloutSample(
                prompt_ids=rng.integers(0, 60, p).astype(np.int32),
                response_ids=rng.integers(0, 60, r).astype(np.int32),
                rollout_logp=-rng.random(r).astype(np.float32),
                routes=routes.reshape(p + r - 1, layers, k),
                weight_version="step-3",
                finish_reason="length",
            )
        )
    batch = RolloutBatch.from_samples(samples, num_experts=model.num_moe_experts)
    StepRecords(model, run_id, task_vocab(model.vocab_size)).stamp(batch)
    return batch.save(tmp_path / name)


def _learner(run_id="learner00001", tokenizer=None, **model_changes) -> StepRecords:
    model = MODEL.model_copy(update=model_changes)
    return StepRecords(model, run_id, tokenizer or task_vocab(model.vocab_size), source=SOURCE)


def test_fingerprint_run_id_and_digest_round_trip(tmp_path):
    path = _records(tmp_path)
    batch = RolloutBatch.load(path)
    assert batch.run_id == "producer0001" and batch.weight_versions == ["step-3"] * 3
    assert batch.fingerprint == architecture_fingerprint(MODEL, task_vocab(64))
    assert batch.fingerprint["model.num_moe_experts"] == 8 and batch.fingerprint["tokenizer.vocab"].endswith(
        "(64 tokens)"
    )
    data = path.read_bytes()  # format 3: the identity is the header's digest (it holds every chunk's digest)
    assert batch.sha256 == hashlib.sha256(data[8 : 8 + int.from_bytes(data[:8], "little")]).hexdigest()[:32]
    picked = batch.select([2, 0])
    assert (picked.fingerprint, picked.run_id) == (batch.fingerprint, batch.run_id)


def test_every_model_field_is_classified():
    """A new ModelConfig field must be put in ARCHITECTURE_FIELDS (shapes routing / log-probs: records made
    with another value are refused) or TRAINING_ONLY_FIELDS (records/fingerprint.py)."""
    fields, arch, other = set(ModelConfig.model_fields), set(ARCHITECTURE_FIELDS), set(TRAINING_ONLY_FIELDS)
    assert not arch & other
    assert fields == arch | other, f"unclassified model fields: {sorted(fields - arch - other)}"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_moe_experts": 16}, "records were made for 8 experts; model.num_moe_experts=16"),
        ({"moe_router_topk": 3}, "records were made with top-2 routing; model.moe_router_topk=3"),
        ({"num_layers": 3}, r"records were made for 2 MoE layers; the model has 3 \(model.num_layers=3"),
        ({"vocab_size": 32}, r"_ids must be in \[0, model.vocab_size=32\)"),
        ({"hidden_size": 32}, "another architecture .model.hidden_size: 64 in the records, 32 here.; train on"),
        (
            {"rotary_base": 10000.0, "moe_router_score_function": "sigmoid"},
            'model.moe_router_score_function: "softmax" in the records, "sigmoid" here; model.rotary_base',
        ),
        (
            {"tokenizer": {"<pad>": 0, "a": 1}},
            (
                r"tokenizer.vocab: \"[0-9a-f]{16} \(64 tokens\)\" in the records, "
                r"\"[0-9a-f]{16} \(2 tokens\)\" here"
            ),
        ),
    ],
    ids=["experts", "top_k", "layers", "vocab", "fingerprint_hidden_size", "fingerprint_two_fields", "tokenizer"],
)
def test_records_for_another_model_are_refused_in_one_line(tmp_path, change, message):
    path = _records(tmp_path)
    with pytest.raises(RecordError, match=message) as info:
        _learner(**change).load(path)
    text = str(info.value)
    assert text.startswith(f"{SOURCE}: {path}: ") and "\n" not in text


def test_another_runs_records_load_with_one_warning_and_a_metric(tmp_path, caplog):
    paths = [_records(tmp_path, name=f"step_00000{i}.safetensors", seed=i) for i in range(2)]
    learner = _learner()
    with caplog.at_level(logging.WARNING, logger="moe_rl.source.step_records"):
        batches = [learner.load(p) for p in paths]
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "produced by run producer0001, not this run (learner00001)" in warnings[0]
    assert [learner.step_metrics(b) for b in batches] == [{"records/other_run": 1.0}] * 2
    caplog.clear()
    same = _learner(run_id="producer0001")
    with caplog.at_level(logging.WARNING, logger="moe_rl.source.step_records"):
        assert same.step_metrics(same.load(paths[0])) == {"records/other_run": 0.0}
    assert not caplog.records


def _committed_records_learner(*overrides: str) -> StepRecords:
    cfg = load_config(CONFIG, [*SHAPE, f"train.rollouts_from={RECORDS}", *overrides])
    return StepRecords.for_trainer(cfg, run_id="learner00001")


def test_old_records_without_a_fingerprint_load_with_a_warning(caplog):
    learner = _committed_records_learner()
    with caplog.at_level(logging.WARNING, logger="moe_rl.source.step_records"):
        batch = learner.load(RECORDS / "step_000000.safetensors")
        learner.load(RECORDS / "step_000001.safetensors")
    assert batch.fingerprint is None and batch.run_id is None and len(batch) == 16
    assert len(caplog.records) == 1 and "no fingerprint or producing run" in caplog.records[0].getMessage()
    assert learner.step_metrics(batch) == {"records/other_run": 1.0}


def test_old_records_are_still_checked_against_the_model():
    """The issue's command: 8-expert records, model.num_moe_experts=16 -> one line naming the key."""
    with pytest.raises(RecordError) as info:
        _committed_records_learner("model.num_moe_experts=16").load(RECORDS / "step_000000.safetensors")
    assert str(info.value) == (
        f"train.rollouts_from={RECORDS}: {RECORDS}/step_000000.safetensors: "
        f"records were made for 8 experts; model.num_moe_experts=16"
    )


def test_a_stale_file_is_refused_by_its_digest(tmp_path):
    """What a rank other than 0 does: the bytes it reads must be those rank 0 read (its sha256)."""
    path = _records(tmp_path)
    digest = RolloutBatch.load(path).sha256
    assert len(RolloutBatch.load(path, sha256=digest)) == 3
    stale = _records(tmp_path, name="stale.safetensors", seed=7)  # a well-formed file from an earlier session
    shutil.copyfile(stale, path)
    with pytest.raises(RecordError, match=f"{path}: content has sha256 [0-9a-f]{{16}}..., expected {digest[:16]}"):
        RolloutBatch.load(path, sha256=digest)


def test_records_inspect_shows_fingerprint_and_producing_run(tmp_path, capsys):
    path = _records(tmp_path)
    assert main(["records", "inspect", str(path)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["run_id"] == "producer0001" and out["weight_versions"] == ["step-3"]
    assert out["fingerprint"]["model.moe_router_topk"] == 2 and len(out["fingerprint_id"]) == 12
    assert main(["records", "inspect", str(RECORDS / "step_000000.safetensors")]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["fingerprint"] is None
    assert "no architecture fingerprint or producing run" in captured.err
