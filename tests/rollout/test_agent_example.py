"""The multi-turn example (``configs/agent_cpu.yaml``, ``scripts/make_agent_example.py``): its pieces are what the
built-in tool loop needs, its config passes the preflight (also in true-on-policy fp32), and held-out evaluation
of an agent run goes through the agent loop. Whether it learns is a benchmark, not CI
(``bench/bench_agent_example.py``, docs/benchmarks.md).

* The tool-calling template appends tool turns: the loop's token-in-token-out prompt after a tool call (the
  trajectory's tokens + ``env_tokens``) equals the whole conversation rendered from scratch, and the SFT trace's
  call parses to ``lookup`` with the box as written, whose reply is the box's code (the dataset's label).
* ``moe-rl config validate configs/agent_cpu.yaml`` passes on the (untrained) example directory, and so does the
  preflight with ``rollout.true_on_policy=true rollout.dtype=float32``.
* ``Evaluator`` with ``rollout.agent``: the eval samples are the agent's trajectories (two turns each with
  ``tests.exact.trajectory_agent:two_turns``) on the session's real SGLang server, scored on the last turn.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from moe_rl.cli import main
from moe_rl.config import load_config
from moe_rl.data.chat import load_tokenizer
from moe_rl.preflight import config_problems
from moe_rl.reward.scorer import build_rewarder
from moe_rl.rollout.agents import AgentContext, load_tools
from moe_rl.rollout.client import RolloutClient
from moe_rl.rollout.tool_loop import env_tokens, parse_tool_calls
from moe_rl.source.evaluate import Evaluator
from moe_rl.tasks.lookup import box_code, lookup

ROOT = Path(__file__).parents[2]
CONFIG = ROOT / "configs" / "agent_cpu.yaml"


def _script():
    spec = importlib.util.spec_from_file_location("make_agent_example", ROOT / "scripts/make_agent_example.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


@pytest.fixture(scope="module")
def script():
    return _script()


@pytest.fixture(scope="module")
def unbuilt_model(script, tmp_path_factory):
    """The example's HF directory without its SFT: tokenizer, tool-calling template, config, random weights."""
    out = tmp_path_factory.mktemp("agent_example") / "model"
    script.write_model(ROOT / "examples/agent", out, sft_steps=0, tool_fraction=0.0)
    return out


def test_the_template_appends_tool_turns_and_the_traced_call_reaches_the_tool(script):
    tok = script.build_tokenizer()
    context = AgentContext(tokenizer=tok, tools=load_tools(script.TOOLS))
    box = "482"
    user = [{"role": "user", "content": script.question(box)}]
    prompt = tok.apply_chat_template(user, add_generation_prompt=True, tokenize=True, return_dict=False)
    call = tok.encode(script.tool_call_text(box), add_special_tokens=False) + [tok.eos_token_id]
    (parsed,), problems = parse_tool_calls(tok.decode(call, skip_special_tokens=False), context.tools)
    assert problems == [] and parsed.name == "lookup" and parsed.arguments == {"box": box}
    reply = context.tools["lookup"].fn(**parsed.arguments)
    assert reply == box_code(box) == lookup(box) and len(reply) == 2 and reply.isdigit()

    tool_msg = [{"role": "tool", "name": "lookup", "content": reply}]
    loop_prompt = prompt + call + env_tokens(context, tool_msg, ended_with_eos=True)
    whole = user + [{"role": "assistant", "content": script.tool_call_text(box)}] + tool_msg
    rendered = tok.apply_chat_template(whole, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert loop_prompt == rendered  # token in, token out: what the model sees is the template's conversation

    ((ids, mask),) = script.traces(tok, [box], tool_fraction=1.0, seed=0)
    assert ids == loop_prompt + tok.encode(reply, add_special_tokens=False) + [tok.eos_token_id]
    assert sum(mask) == len(call) + len(reply) + 1  # the loss: the call and the answer, never the tool's reply


def test_the_dataset_labels_are_the_tools_codes_and_the_splits_are_disjoint():
    rows = {
        name: [json.loads(line) for line in (ROOT / "examples/agent" / name).read_text().splitlines()]
        for name in ("train.jsonl", "test.jsonl")
    }
    boxes = {name: [r["prompt"].rsplit(" ", 1)[1].rstrip("?") for r in part] for name, part in rows.items()}
    assert len(rows["train.jsonl"]) == 800 and len(rows["test.jsonl"]) == 200
    assert not set(boxes["train.jsonl"]) & set(boxes["test.jsonl"])
    for name, part in rows.items():
        assert [r["label"] for r in part] == [box_code(b) for b in boxes[name]]


@pytest.mark.parametrize("extra", [[], ["rollout.true_on_policy=true", "rollout.dtype=float32"]], ids=["bf16", "exact"])
def test_agent_cpu_validates_and_passes_the_preflight(unbuilt_model, extra, capsys):
    overrides = [f"model.hf_path={unbuilt_model}", *extra]
    assert config_problems(load_config(CONFIG, overrides)).problems == []
    assert main(["config", "validate", str(CONFIG), *overrides]) == 0
    assert capsys.readouterr().out.startswith(f"ok: {CONFIG}")


@pytest.mark.sglang
def test_held_out_evaluation_of_an_agent_run_goes_through_the_agent_loop(sglang_server, model_dir, tmp_path):
    """The session server's tiny model (digit-task tokenizer, no chat template) with a scripted two-turn agent."""
    data = tmp_path / "eval.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"copy {i} {i + 1} :", "label": "1"}) + "\n" for i in range(3)))
    cfg = load_config(
        None,
        [
            f"model.hf_path={model_dir}",
            f"data.train_files=[{data}]",
            f"data.eval_files=[{data}]",
            "data.prompt_key=prompt",
            "data.label_key=label",
            "data.apply_chat_template=false",  # the digit-task tokenizer has no chat template
            "reward.type=exact_match",
            "rollout.agent=tests.exact.trajectory_agent:two_turns",
            "rollout.max_new_tokens=3",
            "rollout.dtype=float32",
            "eval.samples_per_prompt=2",
            "rollout.health_timeout_s=300",  # the shared server may be busy with a loaded machine: not what is tested
        ],
    )
    tokenizer = load_tokenizer(cfg)
    rewarder = build_rewarder(cfg, tokenizer)
    try:
        metrics = Evaluator(cfg, tokenizer, rewarder).run(RolloutClient.from_config(cfg, [sglang_server.url]), 0)
    finally:
        rewarder.close()
    assert metrics["eval/eval/turns_mean"] == 2.0 and metrics["eval/eval/tool_calls_mean"] == 0.0
    assert 0.0 <= metrics["eval/eval/pass@1"] <= 1.0
    # both turns' tokens and the environment's: 3 + 3 generated at most, 3 environment tokens
    assert 3 + 2 <= metrics["eval/eval/response_len_mean"] <= 3 + 3 + 3
