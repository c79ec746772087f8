"""The built-in tool loop (moe_rl.rollout.tool_loop) and the agent interface, without a server.

A random tiny model cannot be made to emit tool calls, so the policy here is scripted: a generate handle with
``TurnGenerate``'s signature that records scripted replies through the real stitcher (``Trajectory.plan_turn`` /
``add_turn``). The tokenizer is a byte-level BPE with a Hermes / Qwen3-style tool template, built locally.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from moe_rl.config import load_config
from moe_rl.config.rollout_sections import RolloutConfig
from moe_rl.preflight import config_problems
from moe_rl.records import RolloutSample
from moe_rl.rollout.agents import AgentContext, AgentError, AgentSample, load_agent, load_tools
from moe_rl.rollout.tool_loop import ToolAgentLoop, parse_tool_calls
from moe_rl.rollout.turns import Trajectory, route_conflicts, shared_prefix_len

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]
TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools><|im_end|>\n"
    "{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "\n<tool_response>\n{{ m.content }}\n</tool_response>"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOLS = [f"tests.rollout.agent_tools:{name}" for name in ("add", "fail", "slow", "info", "blob")]


@pytest.fixture(scope="module")
def tokenizer():
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    core.train_from_iterator(
        ['{"name": "add", "arguments": {"a": 2, "b": 3}}', "user assistant tool_response"], trainer
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>", clean_up_tokenization_spaces=False
    )
    tok.chat_template = TEMPLATE
    return tok


class ScriptedPolicy:
    """Replies with the scripted texts in turn (cut at ``max_new_tokens``, like the server), through the real
    stitcher; log-probs are -turn so each token's turn is visible."""

    def __init__(self, tokenizer, replies: list[str]):
        self.tokenizer, self.replies, self.prompts = tokenizer, list(replies), []

    async def __call__(self, trajectory, prompt_ids, max_new_tokens=None):
        start = trajectory.plan_turn(prompt_ids)
        self.prompts.append(list(prompt_ids))
        ids = self.tokenizer.encode(self.replies[trajectory.turns], add_special_tokens=False)
        ids += [self.tokenizer.eos_token_id]
        finish = "stop"
        if max_new_tokens is not None and len(ids) > max_new_tokens:
            ids, finish = ids[:max_new_tokens], "length"
        sample = RolloutSample(
            prompt_ids=np.asarray(prompt_ids, np.int32),
            response_ids=np.asarray(ids, np.int32),
            rollout_logp=np.full(len(ids), -1.0 - trajectory.turns, np.float32),
            finish_reason=finish,
        )
        return trajectory.add_turn(prompt_ids, sample, start)


def _run(tokenizer, replies, **limits):
    context = AgentContext(tokenizer=tokenizer, tools=load_tools(TOOLS), **({"max_total_tokens": 4096} | limits))
    agent = load_agent("moe_rl.rollout.tool_loop:ToolAgentLoop", context)
    policy = ScriptedPolicy(tokenizer, replies)
    sample = AgentSample(messages=[{"role": "user", "content": "What is 2 + 3?"}], group_id=7)
    return asyncio.run(agent(sample, policy)), policy


def call(name, **arguments):
    import json  # noqa: PLC0415 -- a one-line helper of the scripts

    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def test_a_tool_call_turn_feeds_the_result_back_as_environment_tokens_that_never_train(tokenizer):
    traj, policy = _run(tokenizer, [call("add", a=2, b=3), "The answer is 5."])
    assert traj.turns == 2 and traj.marks["stop"] == "answer" and traj.group_id == 7
    assert traj.metrics["agent/tool_calls"] == 1 and not traj.metrics["agent/tool_errors"]
    roles = [s.role for s in traj.segments]
    assert roles == ["prompt", "generated", "environment", "generated"]
    env = tokenizer.decode(traj.segments[2].token_ids, skip_special_tokens=False)
    assert "<tool_response>\n5\n</tool_response>" in env and env.endswith("<|im_start|>assistant\n")
    # token in, token out: turn 2's prompt is turn 1's trajectory plus the environment tokens, and equals the
    # template's rendering of the whole conversation (the scripted texts round-trip through the tokenizer)
    messages = [
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": call("add", a=2, b=3)},
        {"role": "tool", "name": "add", "content": "5"},
    ]
    schemas = [t.schema for t in load_tools(TOOLS).values()]
    rendered = tokenizer.apply_chat_template(
        messages, tools=schemas, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert policy.prompts[1] == list(rendered)
    mask = traj.loss_mask
    assert mask.sum() == traj.generated_tokens == len(traj.segments[1]) + len(traj.segments[3])
    logp_turns = np.concatenate([s.logp for s in traj.segments if s.role == "generated"])
    np.testing.assert_array_equal(np.unique(logp_turns), [-2.0, -1.0])
    assert all(s.logp is None for s in traj.segments if s.role != "generated")
    assert traj.turn_ids[-1] == 2


@pytest.mark.parametrize(
    "reply, counter, fed_back",
    [
        (call("fail", x="k"), "agent/tool_errors", "error: tool 'fail' raised RuntimeError: no such record 'k'"),
        (call("slow", x="k"), "agent/tool_timeouts", "error: tool 'slow' timed out after 0.05 s"),
        (call("add", a=1), "agent/tool_errors", "error: tool 'add' raised TypeError"),
        (call("info", x="k"), "agent/non_text_tool_returns", '{"x": "k", "n": 3}'),
        (call("blob", x="k"), "agent/non_text_tool_returns", "error: tool 'blob' returned a object, not text"),
        ("<tool_call>\n{not json}\n</tool_call>", "agent/malformed_tool_calls", "error: malformed tool call (not JSON"),
        (call("nope", x=1), "agent/malformed_tool_calls", "error: unknown tool 'nope'"),
        ("<tool_call>\n" + '{"name": "add"', "agent/malformed_tool_calls", "without </tool_call>"),
    ],
)
def test_tool_failures_are_a_tool_message_and_a_counter_never_a_crash(tokenizer, reply, counter, fed_back):
    traj, _ = _run(tokenizer, [reply, "Sorry."], tool_timeout_s=0.05)
    assert traj.turns == 2 and traj.marks["stop"] == "answer"
    assert traj.metrics[counter] == 1
    env = tokenizer.decode(traj.segments[2].token_ids, skip_special_tokens=False)
    assert fed_back in env, env


def test_the_token_budget_and_max_turns_end_a_trajectory_with_a_mark(tokenizer):
    first, reply = len(_first_prompt(tokenizer)), len(tokenizer.encode(call("add", a=2, b=3))) + 1
    budget, _ = _run(tokenizer, [call("add", a=2, b=3)] * 4, max_total_tokens=first + reply + 3)
    assert budget.marks["stop"] == "budget" and budget.metrics["agent/budget_stops"] == 1
    assert budget.turns == 1 and len(budget) == first + reply and budget.segments[-1].role == "generated"
    cut, _ = _run(tokenizer, [call("add", a=2, b=3)] * 4, max_total_tokens=first + 5)
    assert cut.segments[-1].finish_reason == "length" and len(cut) == first + 5
    turns, _ = _run(tokenizer, [call("add", a=2, b=3)] * 4, max_turns=3)
    assert turns.turns == 3 and turns.marks["stop"] == "max_turns" and turns.metrics["agent/max_turns_stops"] == 1
    assert turns.metrics["agent/tool_calls"] == 2


def _first_prompt(tokenizer):
    schemas = [t.schema for t in load_tools(TOOLS).values()]
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    return tokenizer.apply_chat_template(
        messages, tools=schemas, add_generation_prompt=True, tokenize=True, return_dict=False
    )


def test_parse_finds_every_call_and_names_each_malformed_one():
    tools = load_tools(TOOLS)
    calls, problems = parse_tool_calls(call("add", a=1, b=2) + " and " + call("info", x="y") + "<tool_call>[1]", tools)
    assert [c.name for c in calls] == ["add", "info"] and calls[0].arguments == {"a": 1, "b": 2}
    assert problems == ["malformed tool call: <tool_call> without </tool_call>"]


def test_agent_and_tool_keys_are_checked_with_one_clear_line(tokenizer):
    with pytest.raises(AgentError, match=r"rollout.agent='moe_rl.rollout.tool_loop:Nope'.*has no 'Nope'"):
        load_agent("moe_rl.rollout.tool_loop:Nope", AgentContext(tokenizer=tokenizer))
    with pytest.raises(AgentError, match="two tools named 'add'"):
        load_tools(["tests.rollout.agent_tools:add", "tests.rollout.agent_tools:add"])
    with pytest.raises(AgentError, match="needs the model's tokenizer"):
        ToolAgentLoop(AgentContext())
    rollout = RolloutConfig(agent="moe_rl.rollout.tool_loop:ToolAgentLoop", tools=TOOLS, agent_max_turns=3)
    context = AgentContext.from_rollout_config(rollout, tokenizer)
    assert sorted(context.tools) == ["add", "blob", "fail", "info", "slow"] and context.max_turns == 3
    cfg = load_config(None, ["rollout.agent=moe_rl.rollout.tool_loop:ToolAgentLoop", "rollout.tools=[math:nope]"])
    assert [p for p in config_problems(cfg).problems if "rollout.tools" in p] == [
        "rollout.tools='math:nope': 'math' has no 'nope'"
    ]
    agent = "rollout.agent=moe_rl.rollout.tool_loop:ToolAgentLoop"
    assert not [p for p in config_problems(load_config(None, [agent])).problems if "rollout.agent" in p]  # sync: trains
    for mode in (["train.rollout_mode=async"], ["train.rollout_mode=async", "rollout.partial=true"]):  # issue 56
        cfg = load_config(None, [agent, *mode, "rollout.addresses=[http://127.0.0.1:1]"])
        assert not [p for p in config_problems(cfg).problems if "rollout.agent" in p], mode
    cfg = load_config(None, [agent, "advantage.estimator=remax"])
    assert [p for p in config_problems(cfg).problems if "rollout.agent" in p] == [
        (
            "rollout.agent='moe_rl.rollout.tool_loop:ToolAgentLoop' with advantage.estimator=remax: ReMax's greedy "
            "baseline response is not built for agent loops; choose another advantage.estimator"
        )
    ]
    assert not [p for p in config_problems(load_config(None, [])).problems if "rollout.agent" in p]


def test_stitching_checks_the_reply_and_compares_routes_as_expert_sets():
    assert shared_prefix_len(np.array([1, 2, 3]), np.array([1, 2, 4, 5])) == 2
    assert shared_prefix_len(np.array([1, 2]), np.array([1, 2, 3])) == 2
    rows = np.array([[[0, 1]], [[2, 3]], [[4, 5]]])
    assert route_conflicts(rows, rows[:, :, ::-1]) == 0  # top-k order is not a conflict
    assert route_conflicts(rows, np.array([[[0, 1]], [[2, 4]], [[5, 4]]])) == 1
    traj = Trajectory()
    sample = RolloutSample(
        prompt_ids=np.array([1, 2], np.int32),
        response_ids=np.array([3], np.int32),
        rollout_logp=np.zeros(1, np.float32),
        routes=rows[:2],
    )
    traj.add_turn([1, 2], sample, traj.plan_turn([1, 2]))
    assert traj.plan_turn([1, 2, 3, 9]) == 2  # the boundary row: token 3 was sampled, never forwarded
    with pytest.raises(ValueError, match="the reply's prompt is not the turn's prompt"):
        traj.add_turn([1, 2, 3, 9], sample, 2)
    with pytest.raises(ValueError, match="rollout.agent_rerender='keep'"):
        traj.plan_turn([1, 2, 3], rerender="keep")
