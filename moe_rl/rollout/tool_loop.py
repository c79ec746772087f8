"""The built-in tool-calling agent loop: Hermes / Qwen3 ``<tool_call>{json}</tool_call>`` through the chat template.

``rollout.agent: moe_rl.rollout.tool_loop:ToolAgentLoop`` (docs/agents.md). Owns, per sample:

* the first prompt: the sample's messages through ``tokenizer.apply_chat_template(..., tools=<schemas>,
  add_generation_prompt=True, **data.chat_template_kwargs)`` (or its ``prompt_ids`` as they are);
* each turn: generate (``TurnGenerate``), decode, parse every ``<tool_call>`` block, call the tools (a timeout,
  an exception, arguments a tool rejects -> an ``error: ...`` tool message), and append the tool messages'
  tokens to the trajectory's own tokens -- **token in, token out**: the history is never re-rendered, the new
  messages are rendered as the template's delta after a fixed conversation (``env_tokens``);
* the limits: ``max_turns`` and ``max_total_tokens`` (each turn asks for at most what the budget has left).

Every failure of a tool or of the model's call ends in a defined trajectory and a counter, never a crash:
``agent/tool_calls``, ``agent/tool_errors``, ``agent/tool_timeouts``, ``agent/malformed_tool_calls``,
``agent/non_text_tool_returns``, ``agent/budget_stops``, ``agent/max_turns_stops``; ``marks["stop"]`` says why
the trajectory ended (``answer``, ``max_turns``, ``budget``).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
from dataclasses import dataclass

from moe_rl.rollout.agents import AgentContext, AgentError, AgentSample, Tool
from moe_rl.rollout.turns import Trajectory, TurnGenerate

__all__ = ["ToolAgentLoop", "ToolCall", "env_tokens", "parse_tool_calls", "run_tool"]

CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_PROBE = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict


def parse_tool_calls(text: str, tools: dict[str, Tool]) -> tuple[list[ToolCall], list[str]]:
    """The well-formed calls in ``text`` and one problem line per malformed one (bad JSON, no name, an unknown
    tool, arguments that are not an object, an unclosed ``<tool_call>``)."""
    calls, problems = [], []
    for body in CALL_RE.findall(text):
        try:
            obj = json.loads(body)
        except ValueError as err:
            problems.append(f"malformed tool call (not JSON: {err.msg}): {body.strip()[:200]}")
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            problems.append(f"malformed tool call (expected {{'name': ..., 'arguments': {{...}}}}): {body[:200]}")
            continue
        args = obj.get("arguments", {})
        if isinstance(args, str):  # some models send the arguments JSON-encoded
            try:
                args = json.loads(args)
            except ValueError:
                pass
        if not isinstance(args, dict):
            problems.append(f"malformed tool call to {obj['name']!r}: arguments must be an object")
        elif obj["name"] not in tools:
            problems.append(f"unknown tool {obj['name']!r}; available: {sorted(tools)}")
        else:
            calls.append(ToolCall(obj["name"], args))
    if text.count("<tool_call>") > text.count("</tool_call>"):
        problems.append("malformed tool call: <tool_call> without </tool_call>")
    return calls, problems


async def run_tool(tool: Tool, arguments: dict, timeout_s: float, metrics) -> str:
    """Call one tool and return the text fed back to the model; every failure becomes an ``error: ...`` text
    and a counter. A synchronous tool runs in a thread (a timed-out one finishes there, unawaited)."""
    metrics["agent/tool_calls"] += 1
    try:
        if inspect.iscoroutinefunction(tool.fn):
            out = await asyncio.wait_for(tool.fn(**arguments), timeout_s)
        else:
            out = await asyncio.wait_for(asyncio.to_thread(tool.fn, **arguments), timeout_s)
    except TimeoutError:
        metrics["agent/tool_timeouts"] += 1
        return f"error: tool {tool.name!r} timed out after {timeout_s:g} s"
    except Exception as err:  # noqa: BLE001 -- a tool's failure is the model's observation, not the batch's
        metrics["agent/tool_errors"] += 1
        return f"error: tool {tool.name!r} raised {type(err).__name__}: {str(err)[:300]}"
    if isinstance(out, str):
        return out
    metrics["agent/non_text_tool_returns"] += 1
    try:
        return json.dumps(out)
    except (TypeError, ValueError):
        return f"error: tool {tool.name!r} returned a {type(out).__name__}, not text"


def _render(tokenizer, messages, generation_prompt: bool, context: AgentContext) -> list[int]:
    schemas = [t.schema for t in context.tools.values()] or None
    ids = tokenizer.apply_chat_template(
        messages,
        tools=schemas,
        add_generation_prompt=generation_prompt,
        tokenize=True,
        return_dict=False,
        **context.chat_template_kwargs,
    )
    return [int(i) for i in ids]


def env_tokens(context: AgentContext, messages: list[dict], ended_with_eos: bool) -> list[int]:
    """The tokens that follow a generated turn for ``messages`` (tool results) up to the next generation prompt:
    the template's rendering of them after a fixed conversation, preceded by what the template puts after an
    assistant turn's end token (and the end token itself when the turn was cut without it)."""
    tok = context.tokenizer
    before = _render(tok, _PROBE, False, context)
    after = _render(tok, _PROBE + messages, True, context)
    if after[: len(before)] != before:
        raise AgentError(
            "the chat template renders a conversation differently once tool messages follow it; the built-in tool "
            "loop needs a template that appends tool turns (Hermes / Qwen3 style)"
        )
    eos = tok.eos_token_id
    closing = before[len(before) - before[::-1].index(eos) :] if eos in before else []
    return ([] if ended_with_eos or eos is None else [int(eos)]) + closing + after[len(before) :]


class ToolAgentLoop:
    """The built-in loop (a class: built once per run with the ``AgentContext``; ``run`` per sample)."""

    def __init__(self, context: AgentContext):
        if context.tokenizer is None:
            raise AgentError("the tool loop needs the model's tokenizer (with a chat template)")
        self.context = context

    def first_prompt(self, sample: AgentSample) -> list[int]:
        if sample.prompt_ids is not None:
            return [int(i) for i in sample.prompt_ids]
        if not sample.messages:
            raise AgentError("an agent sample needs messages or prompt_ids")
        return _render(self.context.tokenizer, sample.messages, True, self.context)

    def decode(self, ids) -> str:
        size = len(self.context.tokenizer)
        return self.context.tokenizer.decode([int(i) for i in ids if 0 <= i < size], skip_special_tokens=False)

    async def run(self, sample: AgentSample, generate: TurnGenerate) -> Trajectory:
        ctx, traj = self.context, Trajectory(group_id=sample.group_id)
        prompt = self.first_prompt(sample)
        eos = ctx.tokenizer.eos_token_id
        for turn in range(ctx.max_turns):
            room = ctx.max_total_tokens - len(prompt)
            if room <= 0:
                traj.marks["stop"] = "budget"
                traj.metrics["agent/budget_stops"] += 1
                break
            seg = await generate(traj, prompt, max_new_tokens=room)
            calls, problems = parse_tool_calls(self.decode(seg.token_ids), ctx.tools)
            if not calls and not problems:
                traj.marks["stop"] = "answer"
                break
            if turn == ctx.max_turns - 1:
                traj.marks["stop"] = "max_turns"
                traj.metrics["agent/max_turns_stops"] += 1
                break
            traj.metrics["agent/malformed_tool_calls"] += len(problems)
            replies = [
                {
                    "role": "tool",
                    "name": c.name,
                    "content": await run_tool(ctx.tools[c.name], c.arguments, ctx.tool_timeout_s, traj.metrics),
                }
                for c in calls
            ] + [{"role": "tool", "name": "error", "content": f"error: {p}"} for p in problems]
            ended = len(seg) > 0 and int(seg.token_ids[-1]) == eos
            prompt = traj.token_ids.tolist() + env_tokens(ctx, replies, ended)
        traj.marks["turns"] = traj.turns
        return traj
