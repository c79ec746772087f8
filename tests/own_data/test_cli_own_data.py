"""Own model, data and reward through the CLI: an HF Qwen3-MoE directory with its own BPE tokenizer and
chat template, a jsonl train file and a reward file written for verl, trained by ``moe-rl train``.

One SGLang server (the test's own model, so not the session fixture) serves the three runs: 2 steps,
the same run resumed to 4, and 4 straight steps in a fresh directory.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from transformers import AutoTokenizer

from moe_rl.records import RolloutBatch
from moe_rl.rollout.launcher import SGLangServer
from moe_rl.rollout.server_spec import ServerSpec
from moe_rl.train.metrics_log import read_metrics
from tests.own_data.tiny_hf import write_tiny_hf_dir

pytestmark = pytest.mark.sglang

SYSTEM = "You are a helpful math tutor."
ROWS = [
    {"question": "What is 2 + 3?", "answer": "5"},
    {"question": "Compute 7 * 6.", "answer": "42", "data_source": "arith"},
    {"question": [{"role": "user", "content": "How many legs does a spider have?"}], "answer": "8"},
    {"question": "the quick brown fox " * 40, "answer": "0"},  # > 120 tokens: dropped at load time
    {"question": "What is 9 - 4?", "answer": "5", "extra_info": {"id": 4}},
    {"question": "What is 1 + 1?", "answer": "2"},
]
REWARD_FILE = """
import json, os

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    with open(os.environ["OWN_DATA_REWARD_LOG"], "a") as fh:
        fh.write(json.dumps([data_source, solution_str, ground_truth, extra_info]) + "\\n")
    return {"score": (len(solution_str) % 3) / 2.0, "length": len(solution_str)}
"""


def make_workspace(root: Path) -> Path:
    """The model directory, train.jsonl, my_reward.py and own_data.yaml under ``root``."""
    write_tiny_hf_dir(root / "model")
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (root / "my_reward.py").write_text(REWARD_FILE)
    config = {
        "name": "own_data",
        "model": {"hf_path": str(root / "model")},
        "rollout": {"dtype": "bfloat16", "max_new_tokens": 8, "samples_per_prompt": 2, "seed": 0},
        "train": {"steps": 2, "prompts_per_step": 2, "micro_batch_size": 4, "seed": 7},
        "data": {
            "train_files": [str(root / "train.jsonl")],
            "prompt_key": "question",
            "label_key": "answer",
            "system_prompt": SYSTEM,
        },
        "reward": {
            "type": "custom",
            "function": f"{root / 'my_reward.py'}:compute_score",
            "num_workers": 1,
            "timeout_s": 120,
        },
        "logging": {"tensorboard": False, "progress": False},
    }
    (root / "own_data.yaml").write_text(yaml.safe_dump(config))
    return root


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return make_workspace(tmp_path_factory.mktemp("own_data"))


@pytest.fixture(scope="module")
def server(workspace):
    spec = ServerSpec(
        model_path=str(workspace / "model"),
        dtype="bfloat16",
        deterministic=True,
        max_total_tokens=4096,
        mem_fraction_static=0.3,
        startup_timeout_s=600,
    )
    with SGLangServer(spec, workspace / "sglang.log") as s:
        yield s.url


def train(workspace, server, out: Path, steps: int, log: Path) -> str:
    """``moe-rl train`` on the shared server; its output. (Written to a file, not a pipe: the trainer's
    torch_shm_manager outlives it while the server still maps the synced tensors, and would hold a pipe open.)"""
    cmd = [
        sys.executable,
        "-m",
        "moe_rl.cli",
        "train",
        str(workspace / "own_data.yaml"),
        f"train.steps={steps}",
        f"train.output_dir={out}",
        f"rollout.addresses=[{server}]",
    ]
    console = workspace / f"console_{out.name}_{steps}.txt"
    with open(console, "w") as fh:
        proc = subprocess.run(
            cmd,
            stdout=fh,
            stderr=subprocess.STDOUT,
            timeout=600,
            env=os.environ | {"OWN_DATA_REWARD_LOG": str(log)},
            check=False,
        )
    text = console.read_text()
    assert proc.returncode == 0, f"moe-rl train failed:\n{text[-6000:]}"
    return text


def records(out: Path, steps: int) -> list[RolloutBatch]:
    return [RolloutBatch.load(out / "rollouts" / f"step_{s:06d}.safetensors") for s in range(steps)]


@pytest.fixture(scope="module")
def two_steps(workspace, server):
    out = workspace / "run_a"
    return out, train(workspace, server, out, 2, workspace / "calls_a.jsonl")


def test_prompts_are_the_chat_template_of_dataset_rows(workspace, two_steps):
    out, console = two_steps
    tok = AutoTokenizer.from_pretrained(workspace / "model", local_files_only=True)
    # rows are read when drawn (issue 40): the overlong row is skipped where the order reaches it, named once
    assert f"data: {workspace / 'train.jsonl'} row 3: the prompt has 522 tokens > 120: skipped" in console
    seen_rows = set()
    for batch in records(out, 2):
        assert batch.data_files is not None and set(batch.data_files) == {str(workspace / "train.jsonl")}
        for i in range(len(batch)):
            row = ROWS[int(batch.data_rows[i])]
            seen_rows.add(int(batch.data_rows[i]))
            q = row["question"]
            messages = [{"role": "system", "content": SYSTEM}] + (
                [{"role": "user", "content": q}] if isinstance(q, str) else q
            )
            want = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
            assert batch.sample(i).prompt_ids.tolist() == want
    assert 3 not in seen_rows and len(seen_rows) >= 2


def test_reward_function_got_the_decoded_responses_and_labels(workspace, two_steps):
    out, _ = two_steps
    tok = AutoTokenizer.from_pretrained(workspace / "model", local_files_only=True)
    calls = [json.loads(line) for line in (workspace / "calls_a.jsonl").read_text().splitlines()]
    expected, rewards = [], []
    for batch in records(out, 2):
        for i in range(len(batch)):
            row = ROWS[int(batch.data_rows[i])]
            text = tok.decode(batch.sample(i).response_ids.tolist(), skip_special_tokens=True)
            extra = row.get("extra_info", {k: v for k, v in row.items() if k not in ("question", "answer")})
            expected.append([row.get("data_source", "train"), text, row["answer"], extra])
            rewards.append((len(text) % 3) / 2.0)
        np.testing.assert_array_equal(batch.rewards, np.float32(rewards[-len(batch) :]))
    key = lambda c: json.dumps(c, sort_keys=True)
    assert collections.Counter(map(key, calls)) == collections.Counter(map(key, expected))
    metrics = read_metrics(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(m["reward/errors"] == 0 and m["reward/length"] >= 0 for m in metrics)


def test_exported_weights_carry_the_tokenizer_and_chat_template(workspace, two_steps):
    out, _ = two_steps
    exported = AutoTokenizer.from_pretrained(out / "hf" / "current", local_files_only=True)
    original = AutoTokenizer.from_pretrained(workspace / "model", local_files_only=True)
    assert exported.chat_template == original.chat_template and exported.get_vocab() == original.get_vocab()


def test_resumed_run_equals_an_uninterrupted_one(workspace, server, two_steps):
    out, _ = two_steps
    train(workspace, server, out, 4, workspace / "calls_a.jsonl")  # resumes at step 2
    straight = workspace / "run_b"
    train(workspace, server, straight, 4, workspace / "calls_b.jsonl")
    for s, (a, b) in enumerate(zip(records(out, 4), records(straight, 4), strict=True)):
        for name in ("prompt_ids", "data_rows", "response_ids", "rewards"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=f"step {s}: {name}")
    rows = [r for b in records(straight, 4) for r in b.data_rows[::2].tolist()]  # one per prompt
    assert sorted(rows[:5]) == [0, 1, 2, 4, 5], "an epoch visits every kept row once"
