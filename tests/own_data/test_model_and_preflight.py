"""``model.hf_path``: the model section read from config.json (both families), and the preflight's messages
for the own-data settings (missing file / key, contradicting model key, no chat template, no directory)."""

from __future__ import annotations

import json

import pytest

from moe_rl.config import ModelConfig, load_config, save_config
from moe_rl.config.hf_model import model_keys_from_hf
from moe_rl.learner.hf_init import hf_config_from_model_config
from moe_rl.preflight import config_problems
from tests.own_data.tiny_hf import write_tiny_hf_dir

GLM = {
    "hf_architecture": "Glm4MoeForCausalLM",
    "moe_router_score_function": "sigmoid",
    "moe_router_enable_expert_bias": True,
    "moe_shared_expert_intermediate_size": 64,
    "moe_ffn_hidden_size": 32,
    "rotary_percent": 0.5,
    "add_qkv_bias": True,
    "first_k_dense_layers": 1,
    "num_layers": 3,
    "moe_router_num_groups": 2,
    "moe_router_group_topk": 1,
    "moe_router_topk_scaling_factor": 2.5,
}
QWEN = {
    "moe_layer_freq": [1, 0, 1],
    "num_layers": 3,
    "moe_router_pre_softmax": True,
    "vocab_size": 1000,
    "seq_length": 4096,
    "rotary_base": 10000.0,
    "layernorm_epsilon": 1e-5,
    "num_query_groups": 1,
    "kv_channels": 8,
}


@pytest.mark.parametrize("keys", [QWEN, GLM], ids=["qwen3_moe", "glm4_moe"])
def test_config_json_gives_back_every_key_hf_init_wrote(keys):
    m = ModelConfig(**keys)
    derived = model_keys_from_hf(json.loads(hf_config_from_model_config(m).to_json_string()))
    for key, value in derived.items():
        assert ModelConfig(**(keys | {key: value})) == m, f"model.{key}: {value!r} vs {getattr(m, key)!r}"


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return write_tiny_hf_dir(tmp_path_factory.mktemp("tiny_bpe_model"))


@pytest.fixture(scope="module")
def train_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    path.write_text(json.dumps({"question": "What is 2 + 3?", "answer": "5"}) + "\n")
    return path


def problems(*overrides):
    return config_problems(load_config(None, list(overrides))).problems


def own(hf_dir, train_file, *more):
    return [
        f"model.hf_path={hf_dir}",
        f"data.train_files=[{train_file}]",
        "data.prompt_key=question",
        "data.label_key=answer",
        "reward.type=math",
        *more,
    ]


def test_a_config_with_only_hf_path_reads_the_architecture(hf_dir, train_file, tmp_path):
    cfg = load_config(None, own(hf_dir, train_file))
    assert (cfg.model.vocab_size, cfg.model.seq_length, cfg.model.num_moe_experts) == (384, 128, 8)
    assert config_problems(cfg).problems == []
    saved = tmp_path / "config.yaml"  # a run's saved config (every key now explicit) loads back equal
    save_config(cfg, saved)
    assert load_config(saved) == cfg


def test_a_model_key_contradicting_config_json_names_both_values(hf_dir, train_file):
    assert problems(*own(hf_dir, train_file), "model.num_layers=4", "model.vocab_size=384") == [
        (
            f"model.num_layers=4 contradicts {hf_dir}/config.json, which gives 2; drop model.num_layers (it is read from "
            "config.json) or set it to 2"
        )
    ]


def test_a_missing_hf_path(tmp_path, train_file):
    assert problems(*own(tmp_path / "nope", train_file)) == [
        (
            f"model.hf_path='{tmp_path / 'nope'}' does not exist or is not a directory; expected a Hugging Face model "
            "directory (config.json, weights, tokenizer)"
        )
    ]


def test_a_missing_train_file_and_a_missing_key_in_the_first_row(hf_dir, train_file, tmp_path):
    assert problems(*own(hf_dir, tmp_path / "missing.jsonl")) == [
        f"data.train_files[0]='{tmp_path / 'missing.jsonl'}' does not exist; expected a local .jsonl, .json or .parquet file"
    ]
    assert problems(*own(hf_dir, train_file), "data.label_key=solution") == [
        f"data.label_key='solution' is not a field of the first row of {train_file} (its keys: ['answer', 'question'])"
    ]


def test_a_chat_template_asked_of_a_tokenizer_without_one(tmp_path, train_file):
    bare = write_tiny_hf_dir(tmp_path / "bare", chat_template=None)
    assert problems(*own(bare, train_file)) == [
        (
            f"data.apply_chat_template=true but the tokenizer of model.hf_path='{bare}' has no chat template; set "
            "data.apply_chat_template=false or add one (chat_template.jinja, or 'chat_template' in tokenizer_config.json)"
        )
    ]
    assert problems(*own(bare, train_file), "data.apply_chat_template=false") == []


def test_reward_and_data_settings_that_cannot_work(hf_dir, train_file):
    assert problems(*own(hf_dir, train_file), "reward.type=task") == [
        (
            "reward.type='task' scores the built-in digit tasks (train.task); with data.train_files expected 'math', "
            "'exact_match' or 'custom'"
        )
    ]
    assert problems(*own(hf_dir, train_file), "reward.type=custom") == [
        "reward.type='custom' needs reward.function ('pkg.module:fn' or 'path/to/file.py:fn')"
    ]
    assert problems(
        f"data.train_files=[{train_file}]", "data.prompt_key=question", "data.label_key=answer", "reward.type=math"
    ) == [
        (
            "data.train_files needs model.hf_path: dataset prompts are tokenised with the model's own tokenizer (the "
            "built-in task tokenizer only knows digits)"
        )
    ]
