"""Issue 40, data at any size and bad rows: prompts made when drawn (not at start-up), jsonl that is not UTF-8,
null labels, a row's own system turn, chat-template options, and an HF directory without a tokenizer."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from moe_rl.config import ConfigError, load_config
from moe_rl.data import build_prompt_stream
from moe_rl.data.chat import load_tokenizer, prompt_ids
from moe_rl.data.dataset import DatasetPrompts, load_prompt_items, reward_needs_label
from moe_rl.data.loaders import DataError, open_rows, read_rows
from moe_rl.learner.hf_init import hf_config_from_model_config
from moe_rl.preflight import config_problems
from moe_rl.preflight.data import data_files
from tests.own_data.tiny_hf import CHAT_TEMPLATE, build_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


class CountingTokenizer:
    """The real tokenizer, counting how many prompts went through its chat template."""

    def __init__(self, tokenizer):
        self.tokenizer, self.calls = tokenizer, 0

    def apply_chat_template(self, *args, **kwargs):
        self.calls += 1
        return self.tokenizer.apply_chat_template(*args, **kwargs)


def cfg_for(tmp_path, files, *more):
    return load_config(
        None,
        [
            f"data.train_files={json.dumps([str(f) for f in files])}",
            "data.prompt_key=q",
            "data.label_key=a",
            "reward.type=math",
            f"train.output_dir={tmp_path / 'run'}",
            *more,
        ],
    )


def test_a_large_parquet_is_tokenised_only_where_the_stream_draws(tmp_path, tok):
    n = 5_000
    path = tmp_path / "big.parquet"
    pq.write_table(pa.table({"q": [f"What is {i} + 1?" for i in range(n)], "a": [str(i + 1) for i in range(n)]}), path)
    cfg = cfg_for(tmp_path, [path])
    counting = CountingTokenizer(tok)
    stream = build_prompt_stream(cfg, counting, log=None)
    assert counting.calls == 0 and stream.state() == {"epoch": 0, "index": 0, "size": n}
    drawn = stream.next_prompts(0, 8)
    assert counting.calls == 8
    for item in drawn:  # the same prompt ids and label the eager reading gives for that row
        assert item.label == str(item.row + 1) and item.file == str(path)
        want = [{"role": "user", "content": f"What is {item.row} + 1?"}]
        assert item.ids == tok.apply_chat_template(want, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert list((tmp_path / "run" / "data_cache").glob("big-*.arrow"))  # the memory-mapped copy, in the run


def test_every_file_form_reads_rows_on_demand_like_the_eager_reader(tmp_path):
    chat = [{"role": "user", "content": "z"}]
    rows = [{"q": chat, "a": "1", "n": [1, 2]}, {"q": chat[::-1], "a": None, "n": []}, {"q": [], "a": "3", "n": [3]}]
    (tmp_path / "d.jsonl").write_text(
        json.dumps(rows[0]) + "\n\n  \n" + json.dumps(rows[1]) + "\n" + json.dumps(rows[2])
    )
    (tmp_path / "d.json").write_text(json.dumps({"data": rows}))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    for suffix in (".jsonl", ".json", ".parquet"):
        lazy = open_rows(tmp_path / f"d{suffix}", tmp_path / "cache")
        got = [lazy[i] for i in range(len(lazy))]
        assert got == rows == read_rows(tmp_path / f"d{suffix}"), suffix


def test_invalid_utf8_names_the_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    lines = [json.dumps({"q": f"row {i}", "a": "1"}).encode() for i in range(6)]
    lines[4] = b'{"q": "caf\xe9", "a": "1"}'  # latin-1, line 5
    path.write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(
        DataError, match=r"bad.jsonl: line 5 is not valid UTF-8 \(invalid continuation byte: byte 0xe9\)"
    ):
        build_prompt_stream(cfg_for(tmp_path, [path]), None)
    with pytest.raises(DataError, match=r"bad.jsonl: line 5 is not valid UTF-8"):
        read_rows(path, limit=10)  # the preflight's look at the first rows


@pytest.mark.parametrize("row", [{"q": "x", "a": None}, {"q": "x"}], ids=["null", "missing"])
def test_a_null_or_missing_label_names_file_and_row(tmp_path, tok, row):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"q": "ok", "a": "1"}) + "\n" + json.dumps(row) + "\n")
    cfg = cfg_for(tmp_path, [path])
    stream = build_prompt_stream(cfg, tok, log=None)
    with pytest.raises(DataError, match=r"d.jsonl row 1 has (a null|no field) data.label_key='a'.*needs_label = False"):
        stream.next_prompts(0, 2)


def test_a_reward_function_that_declares_needs_label_false_gets_none_with_one_warning(tmp_path, tok):
    verl_file = tmp_path / "verl_reward.py"  # a verl reward file as it is: needs a label
    verl_file.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n"
    )
    free = tmp_path / "format_reward.py"
    free.write_text(verl_file.read_text() + "compute_score.needs_label = False\n")
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"q": f"q{i}", "a": None}) + "\n" for i in range(3)))
    assert reward_needs_label(cfg_for(tmp_path, [path]))
    assert reward_needs_label(
        cfg_for(tmp_path, [path], "reward.type=custom", f"reward.function={verl_file}:compute_score")
    )
    cfg = cfg_for(tmp_path, [path], "reward.type=custom", f"reward.function={free}:compute_score")
    assert not reward_needs_label(cfg)
    logged = []
    items = build_prompt_stream(cfg, tok, log=logged.append).next_prompts(0, 3)
    assert [i.label for i in items] == [None] * 3
    assert len(logged) == 1 and "null data.label_key='a': scored with ground_truth=None" in logged[0]


def test_the_preflight_refuses_a_null_label_in_the_first_row(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"q": "x", "a": None}) + "\n")
    problems = list(data_files(cfg_for(tmp_path, [path])))
    assert any(p.startswith(f"data.label_key='a' is null in the first row of {path}") for p in problems), problems


def test_a_rows_own_system_turn_wins_over_the_system_prompt(tmp_path, tok):
    own = [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "2+2?"}]
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"q": own, "a": "4"}) + "\n" + json.dumps({"q": "3+3?", "a": "6"}) + "\n")
    cfg = cfg_for(tmp_path, [path], "data.system_prompt=Be brief.")
    items, _ = load_prompt_items(cfg.data.train_files, tok, cfg, log=None)
    template = lambda m: tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert items[0].ids == template(own)
    assert items[1].ids == template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "3+3?"}])


def test_chat_template_kwargs_reach_the_template(tmp_path):
    thinking = build_tokenizer(
        chat_template=CHAT_TEMPLATE + "{% if enable_thinking is false %}<think>\n\n</think>\n{% endif %}"
    )
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"q": "2+2?", "a": "4"}) + "\n")
    on = prompt_ids(thinking, "2+2?", cfg_for(tmp_path, [path]).data, "x")
    off = prompt_ids(
        thinking, "2+2?", cfg_for(tmp_path, [path], "data.chat_template_kwargs={enable_thinking: false}").data, "x"
    )
    assert thinking.decode(off[len(on) :]) == "<think>\n\n</think>\n" and off[: len(on)] == on

    with pytest.raises(ConfigError, match=r"data.chat_template_kwargs sets \['tokenize'\], which moe_rl fixes"):
        cfg_for(tmp_path, [path], "data.chat_template_kwargs={tokenize: false}")


def test_overlong_rows_are_skipped_where_they_fall_and_all_overlong_is_an_error(tmp_path, tok):
    path = tmp_path / "d.jsonl"
    rows = [{"q": "1 + 1", "a": "2"}, {"q": "the quick brown fox " * 30, "a": "0"}, {"q": "2 + 2", "a": "4"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = cfg_for(tmp_path, [path], "data.max_prompt_tokens=40", "data.shuffle=false")
    logged = []
    stream = build_prompt_stream(cfg, tok, log=logged.append)
    assert [i.row for i in stream.next_prompts(0, 4)] == [0, 2, 0, 2]
    assert "d.jsonl row 1: the prompt has" in logged[0] and "skipped" in logged[0]
    path.write_text(json.dumps(rows[1]) + "\n")
    with pytest.raises(DataError, match=r"no usable prompt \(all 1 rows are longer than 40 tokens\)"):
        build_prompt_stream(cfg, tok, log=None).next_prompts(0, 1)


def test_an_hf_directory_without_tokenizer_files_is_refused_up_front(tmp_path, tiny_model_cfg):
    bare = tmp_path / "bare"  # config.json and weights, no tokenizer files
    bare.mkdir()
    (bare / "config.json").write_text(hf_config_from_model_config(tiny_model_cfg).to_json_string())
    (bare / "model.safetensors").write_bytes(b"")  # the preflight only looks for a weights file
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"q": "x", "a": "1"}) + "\n")
    cfg = load_config(
        None,
        [
            f"model.hf_path={bare}",
            f"data.train_files=[{data}]",
            "data.prompt_key=q",
            "data.label_key=a",
            "reward.type=math",
            "data.apply_chat_template=false",
        ],
    )
    problems = config_problems(cfg).problems
    assert (
        [p for p in problems if "tokenizer" in p]
        == [
            p
            for p in problems
            if p.startswith(f"model.hf_path={str(bare)!r} has no usable tokenizer: AutoTokenizer loaded")
        ]
        != []
    ), problems
    with pytest.raises(DataError, match="has no usable tokenizer.*expected the model's tokenizer files"):
        load_tokenizer(cfg)


def test_dataset_prompts_index_spans_files_in_order(tmp_path, tok):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("".join(json.dumps({"q": f"a{i}", "a": "1"}) + "\n" for i in range(3)))
    b.write_text("".join(json.dumps({"q": f"b{i}", "a": "1"}) + "\n" for i in range(2)))
    data = DatasetPrompts([str(a), str(b)], tok, cfg_for(tmp_path, [a, b]), log=None)
    assert len(data) == 5 and [(data.get(i).file[-7:], data.get(i).row) for i in (0, 2, 3, 4)] == [
        ("a.jsonl", 0),
        ("a.jsonl", 2),
        ("b.jsonl", 0),
        ("b.jsonl", 1),
    ]


def test_an_empty_file_is_one_clear_error(tmp_path, tok):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n")
    with pytest.raises(DataError, match=r"empty.jsonl'\] hold no rows; expected at least one prompt"):
        build_prompt_stream(cfg_for(tmp_path, [path]), tok, log=None)
