"""Issue 40, starts that fail cleanly: a refused start leaves nothing that makes the next one a resume, a damaged
warm-start cache is named and rebuilt, ``records inspect`` names the short array, and ``config validate`` on a
fresh clone says how to build an example's model."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from safetensors.numpy import save_file as save_numpy
from safetensors.torch import load_file

from moe_rl.cli import main
from moe_rl.config import ParallelConfig, load_config, save_config
from moe_rl.data.loaders import DataError
from moe_rl.data.prompt import PromptItem
from moe_rl.learner.dist import init_distributed
from moe_rl.learner.train_step import Learner
from moe_rl.preflight import config_problems
from moe_rl.records import RecordError, RolloutBatch
from moe_rl.reward import Rewarder, Scores
from moe_rl.source.producer import AsyncProducer
from moe_rl.source.step_samples import StepSamples
from moe_rl.train.resume_rules import RunDirError
from moe_rl.train.run_dir import guard_run_dir
from moe_rl.train.run_identity import new_run_id, write_checkpoint_identity, write_run_id
from moe_rl.train.warm_start import apply_warm_start, cache_path

ROOT = Path(__file__).parents[2]


def _refused_start(run_dir: Path, *overrides: str) -> str:
    """What a start refused before its first step leaves (issue 40): config.yaml, an empty metrics.jsonl,
    run_id and checkpoints/run.json (the trainer writes them once the checkpoint load passed)."""
    cfg = load_config(None, [f"train.output_dir={run_dir}", *overrides])
    save_config(cfg, run_dir / "config.yaml")
    (run_dir / "metrics.jsonl").write_text("")
    run_id = new_run_id()
    write_run_id(run_dir, run_id)
    write_checkpoint_identity(run_dir / "checkpoints", run_id, run_dir)
    return run_id


@pytest.mark.parametrize("resume", ["auto", "never"])
def test_the_corrected_command_after_a_refused_start_starts_fresh(tmp_path, caplog, resume):
    _refused_start(tmp_path, "model.num_moe_experts=4")  # e.g. records made for another model: refused at step 0
    corrected = load_config(None, [f"train.output_dir={tmp_path}", f"checkpoint.resume={resume}"])
    with caplog.at_level("WARNING"):
        guard_run_dir(corrected, tmp_path, tmp_path / "checkpoints").release()
    assert "an earlier start that trained no step left" in caplog.text and "starting fresh" in caplog.text
    left = sorted(p.name for p in tmp_path.rglob("*") if p.is_file() and p.name != ".moe_rl.lock")
    assert left == []  # config.yaml, metrics.jsonl, run_id and run.json are gone: nothing to resume


def test_an_eval_line_at_step_0_is_no_step_but_a_trained_step_still_is_a_run(tmp_path):
    _refused_start(tmp_path, "model.num_moe_experts=4")
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "eval/x/pass@1": 0.1}\n')
    guard_run_dir(load_config(None, [f"train.output_dir={tmp_path}"]), tmp_path, tmp_path / "checkpoints").release()
    _refused_start(tmp_path, "model.num_moe_experts=4")
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n')  # a step trained, no checkpoint yet
    with pytest.raises(RunDirError, match=r"! model.num_moe_experts: 4 -> 8"):
        guard_run_dir(load_config(None, [f"train.output_dir={tmp_path}"]), tmp_path, tmp_path / "checkpoints")


def test_a_damaged_warm_start_cache_is_named_in_one_line_and_rebuilt(tmp_path, capfd, device):
    init_distributed(ParallelConfig(), environ={})
    cfg = load_config(
        ROOT / "configs/demo.yaml", [f"train.warm_start.cache_dir={tmp_path}", "train.warm_start.steps=2"]
    )

    shard = cache_path(cfg) / "rank_00000.safetensors"
    shard.parent.mkdir(parents=True)
    (shard.parent / "meta.json").write_text(json.dumps({"history": [{"nll": 1.0}]}))
    shard.write_bytes(b'\x10\x00\x00\x00\x00\x00\x00\x00{"a": ')  # a torn write: "incomplete metadata"
    learner = Learner(cfg)
    capfd.readouterr()
    info = apply_warm_start(learner, cfg)
    err = capfd.readouterr().err
    damaged = [line for line in err.splitlines() if "is damaged" in line]
    assert len(damaged) == 1 and f"{shard} (SafetensorError" in damaged[0] and "rebuilding" in damaged[0], err
    assert "Traceback" not in err and not info["cached"]
    rebuilt = load_file(str(shard))  # whole again, and what the learner now holds
    assert all(torch.equal(v, learner.module.state_dict()[k].cpu()) for k, v in rebuilt.items())  # host: GPU-safe


def test_records_inspect_names_the_array_that_is_one_row_short(tmp_path, capsys):
    batch = RolloutBatch.load(ROOT / "tests/data/records_tiny_cpu/step_000000.safetensors")
    n = len(batch)
    batch.prompt_lens = batch.prompt_lens[:-1]
    short = tmp_path / "short.safetensors"
    with pytest.raises(RecordError, match=rf"not written: prompt_lens has {n - 1} entries; expected one per sample"):
        batch.save(short)  # format 3 locates each sample's rows: nothing inconsistent is written
    assert not short.exists()
    # a file of the previous format (no chunk index) as another writer could leave it, one row short
    with safe_open(str(ROOT / "tests/data/records_format2/step_000000.safetensors"), "numpy") as f:
        arrays, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()  # noqa: SIM118 -- safe_open's API
    n = len(arrays["prompt_lens"])
    arrays["prompt_lens"] = arrays["prompt_lens"][:-1]
    save_numpy(arrays, str(short), metadata=meta)
    assert main(["records", "inspect", str(short)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"error: {short}: prompt_lens has {n - 1} entries; expected one per sample ({n})"


def test_config_validate_on_a_fresh_clone_says_how_to_build_the_example_model(tmp_path, capsys):
    unbuilt = f"model.hf_path={tmp_path / 'model'}"  # as on a fresh clone: `make math-example` not run yet
    assert main(["config", "validate", str(ROOT / "configs/math_cpu.yaml"), unbuilt]) == 0
    out, err = capsys.readouterr()
    assert out.startswith(f"ok: {ROOT / 'configs/math_cpu.yaml'} (math_cpu: model not built yet")
    assert "is not built yet: run `make math-example` (model.build_command) before training" in err

    cfg = load_config(ROOT / "configs/math_cpu.yaml", [unbuilt])
    assert any("run `make math-example`" in p for p in config_problems(cfg).problems)  # train refuses it


def test_no_label_samples_are_counted_per_step(tmp_path):
    class Constant(Rewarder):
        def score(self, prompts, responses):
            return Scores([1.0] * len(responses))

    class Rows:
        def next_prompts(self, step, n, round=0):
            return [PromptItem(ids=[1], label=None if i % 2 else "1", file="d.jsonl", row=i) for i in range(n)]

    cfg = load_config(
        None,
        [
            "reward.type=math",
            f"data.train_files=[{tmp_path / 'd.jsonl'}]",
            "train.prompts_per_step=4",
            "rollout.samples_per_prompt=2",
        ],
    )
    generate = lambda prompts, r: [
        SimpleNamespace(response_ids=[5], turn_ids=None, agent_reward=None) for p in prompts for _ in range(2)
    ]
    _, metrics = StepSamples(cfg, Rows(), Constant()).make(0, generate)
    assert metrics["reward/no_label"] == 4.0  # 2 of 4 prompts x 2 samples


def test_a_bad_row_drawn_by_the_async_producer_reaches_the_cli_as_its_own_line(tmp_path):
    """Datasets are read when drawn: in async mode that is the producer thread, whose error the learner re-raises."""

    def make(step, served, drawn=None):
        raise DataError(f"{tmp_path}/d.jsonl row 3 has a null data.label_key='a'")

    producer = AsyncProducer(make, 0, 2, 1, served_version=0)
    producer.start()
    try:
        with pytest.raises(DataError, match=r"d.jsonl row 3 has a null data.label_key='a'"):
            producer.batch(0)
    finally:
        producer.close()


def test_a_config_yaml_without_a_trainers_run_id_is_not_taken_for_a_failed_start(tmp_path):
    _refused_start(tmp_path, "model.num_moe_experts=4")
    (tmp_path / "run_id").unlink()  # e.g. the user keeps their own config.yaml in the output directory
    with pytest.raises(RunDirError, match=r"! model.num_moe_experts: 4 -> 8"):
        guard_run_dir(load_config(None, [f"train.output_dir={tmp_path}"]), tmp_path, tmp_path / "checkpoints")
    assert (tmp_path / "config.yaml").is_file()
