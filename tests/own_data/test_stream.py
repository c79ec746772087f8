"""The prompt stream: built-in tasks unchanged, dataset order seeded per epoch, exact resume from a position."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moe_rl.data.prompt import PromptItem
from moe_rl.data.stream import DatasetStream, TaskStream
from moe_rl.records import RolloutBatch, RolloutSample
from moe_rl.tasks.synthetic import DigitTask


def test_task_stream_draws_exactly_what_the_loop_drew_before():
    task = DigitTask("copy_long", 64)
    stream = TaskStream(task, seed=1234)
    for step in (0, 7):
        before = task.sample_prompts(8, np.random.default_rng([1234, step]))  # the loop's former code
        assert [p.task_prompt for p in stream.next_prompts(step, 8)] == before
    assert stream.state() is None


def items(n):
    return [PromptItem(ids=[i], label=str(i), file="f.jsonl", row=i) for i in range(n)]


def test_every_epoch_is_a_new_permutation_of_all_rows():
    stream = DatasetStream(items(5), seed=3)
    rows = [p.row for _ in range(5) for p in stream.next_prompts(0, 2)]  # 10 prompts = 2 epochs
    assert sorted(rows[:5]) == sorted(rows[5:]) == [0, 1, 2, 3, 4]
    assert rows[:5] != rows[5:]
    assert stream.state() == {"epoch": 2, "index": 0, "size": 5}
    unshuffled = DatasetStream(items(3), seed=3, shuffle=False)
    assert [p.row for p in unshuffled.next_prompts(0, 4)] == [0, 1, 2, 0]


def test_resuming_from_a_saved_position_continues_exactly():
    straight = DatasetStream(items(7), seed=11)
    uninterrupted = [[p.row for p in straight.next_prompts(s, 3)] for s in range(4)]
    first = DatasetStream(items(7), seed=11)
    for s in range(2):
        first.next_prompts(s, 3)
    saved = json.loads(json.dumps(first.state()))  # as it goes through checkpoint meta.json
    resumed = DatasetStream(items(7), seed=11)
    resumed.load_state(saved)
    assert [[p.row for p in resumed.next_prompts(s, 3)] for s in (2, 3)] == uninterrupted[2:]


def test_a_position_for_another_dataset_size_is_refused():
    stream = DatasetStream(items(4), seed=0)
    with pytest.raises(ValueError, match="for 5 prompts; data.train_files now yield 4"):
        stream.load_state({"epoch": 0, "index": 1, "size": 5})


def test_records_carry_each_samples_dataset_file_and_row(tmp_path):
    def sample(file, row):
        return RolloutSample(
            prompt_ids=np.array([1, 2], np.int32),
            response_ids=np.array([3], np.int32),
            rollout_logp=np.array([-0.5], np.float32),
            data_file=file,
            data_row=row,
        )

    batch = RolloutBatch.from_samples([sample("a.jsonl", 4), sample("b.parquet", 0), sample("a.jsonl", 9)])
    back = RolloutBatch.load(batch.save(tmp_path / "r.safetensors"))
    assert back.data_files == ["a.jsonl", "b.parquet", "a.jsonl"] and back.data_rows.tolist() == [4, 0, 9]
    assert back.select([2, 0]).data_rows.tolist() == [9, 4]
    plain = RolloutBatch.from_samples([sample("", -1)])  # built-in tasks: no arrays at all
    assert plain.data_files is None and RolloutBatch.load(plain.save(tmp_path / "p.safetensors")).data_rows is None
