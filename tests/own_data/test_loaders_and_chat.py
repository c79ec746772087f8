"""Dataset files (jsonl, json, parquet), prompt forms (string, messages, system prompt) and max_prompt_tokens."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from moe_rl.config import load_config
from moe_rl.data.chat import prompt_ids
from moe_rl.data.dataset import load_prompt_items
from moe_rl.data.loaders import DataError, get_field, read_rows
from tests.own_data.tiny_hf import build_tokenizer

ROWS = [{"q": "What is 2 + 3?", "a": "5", "data_source": "gsm"}, {"q": "Compute 7 * 6.", "a": "42", "n": 1}]


def write(path, rows):
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    else:
        pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def cfg_for(files, **data):
    return load_config(
        None,
        [
            f"data.train_files={json.dumps([str(f) for f in files])}",
            "data.prompt_key=q",
            "data.label_key=a",
            "reward.type=math",
            *(f"data.{k}={json.dumps(v)}" for k, v in data.items()),
        ],
    )


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet"])
def test_each_file_form_reads_the_same_rows(tmp_path, suffix):
    rows = [{"q": "What is 2 + 3?", "a": "5"}, {"q": "Compute 7 * 6.", "a": "42"}]
    assert read_rows(write(tmp_path / f"d{suffix}", rows)) == rows


def test_json_with_a_data_list_and_dotted_keys(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps({"data": [{"p": "x", "reward_model": {"ground_truth": "7"}}]}))
    row = read_rows(path)[0]
    assert get_field(row, "reward_model.ground_truth") == "7"


def test_a_bad_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"q": "x"}\n{not json\n')
    with pytest.raises(DataError, match=r"bad.jsonl: line 2 is not valid JSON"):
        read_rows(path)


def test_string_prompt_is_one_user_message_with_the_system_prompt_first(tmp_path, tok):
    cfg = cfg_for([write(tmp_path / "d.jsonl", ROWS)], system_prompt="Be brief.")
    items, dropped = load_prompt_items(cfg.data.train_files, tok, cfg, log=None)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": ROWS[0]["q"]}]
    want = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert items[0].ids == want and dropped == 0
    assert (items[0].label, items[0].data_source, items[0].row) == ("5", "gsm", 0)
    assert items[1].data_source == "d" and items[1].extra_info == {"n": 1}  # file stem; row minus prompt/label


def test_message_list_prompt_and_plain_text_prompt(tmp_path, tok):
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "2+2?"},
    ]
    cfg = cfg_for([write(tmp_path / "m.jsonl", [{"q": messages, "a": "4"}])])
    items, _ = load_prompt_items(cfg.data.train_files, tok, cfg, log=None)
    assert items[0].ids == tok.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    plain = cfg_for([tmp_path / "m.jsonl"], apply_chat_template=False).data
    assert prompt_ids(tok, "What is 2 + 3?", plain, "x") == tok.encode("What is 2 + 3?", add_special_tokens=True)
    with pytest.raises(DataError, match="needs data.apply_chat_template=true"):
        prompt_ids(tok, messages, plain, "m.jsonl row 0")


def test_max_prompt_tokens_drops_longer_prompts_and_counts_them(tmp_path, tok):
    rows = [{"q": "What is 2 + 3?", "a": "5"}, {"q": "the quick brown fox " * 30, "a": "0"}, {"q": "1 + 1", "a": "2"}]
    cfg = cfg_for([write(tmp_path / "d.jsonl", rows)], max_prompt_tokens=40)
    logged = []
    items, dropped = load_prompt_items(cfg.data.train_files, tok, cfg, log=logged.append)
    assert [i.row for i in items] == [0, 2] and dropped == 1
    assert logged == ["data: dropped 1 prompt(s) longer than 40 tokens (data.overlong_prompts='drop')"]
    strict = cfg_for([tmp_path / "d.jsonl"], max_prompt_tokens=40, overlong_prompts="error")
    with pytest.raises(DataError, match=r"d.jsonl row 1: the prompt has \d+ tokens > 40"):
        load_prompt_items(strict.data.train_files, tok, strict, log=None)


def test_a_later_row_without_the_label_names_file_and_row(tmp_path, tok):
    cfg = cfg_for([write(tmp_path / "d.jsonl", [ROWS[0], {"q": "no label"}])])
    with pytest.raises(DataError, match=r"d.jsonl row 1 has no field data.label_key='a'"):
        load_prompt_items(cfg.data.train_files, tok, cfg, log=None)
