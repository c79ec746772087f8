"""The agent-loop interface: ``rollout.agent: "module:Class"`` (or a function) and ``rollout.tools``.

Owns what an agent loop receives and how it is found (docs/agents.md, "The interface"; issue 56):

* ``AgentSample``: one prompt of the batch (its messages or token ids, label, group and index in the group).
* ``AgentContext``: what every loop of a run shares -- the tokenizer, the registered tools, the limits
  (``max_turns``, ``max_total_tokens``, ``tool_timeout_s``) and ``chat_template_kwargs``.
* ``load_agent(spec)``: ``"module:Name"`` -> a callable ``(sample, generate) -> Trajectory`` (awaitable). A class is
  built once with the context (``Class(context)``) and its ``run(sample, generate)`` is called per sample, as verl's
  ``AgentLoopBase.run``; a function is called as ``fn(sample, generate, context)``, as slime's custom generate.
* ``load_tools(specs)``: ``["module:function", ...]`` -> name -> function, each with its JSON schema.
* ``run_agents``: every sample of a batch through the loop concurrently, all-or-nothing like the client's batch.

``rollout.agent=None`` is today's single-turn path, untouched.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from transformers.utils import get_json_schema

from moe_rl.rollout.client import RolloutClient
from moe_rl.rollout.partial import PartialCounters
from moe_rl.rollout.turns import Trajectory, TurnGenerate

__all__ = [
    "AgentContext",
    "AgentError",
    "AgentSample",
    "Tool",
    "load_agent",
    "load_tools",
    "resolve_spec",
    "run_agents",
]


class AgentError(ValueError):
    """An agent or tool spec that cannot be loaded, or a loop that returned something else than a Trajectory."""


@dataclass
class AgentSample:
    """One prompt for an agent loop: chat ``messages`` (or ``prompt_ids``), its label, group and index."""

    messages: list[dict] | None = None
    prompt_ids: list[int] | None = None
    label: Any = None
    group_id: int = 0
    index: int = 0  # which of the group's n samples
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Tool:
    """A registered tool: its name (the function's), the function and its JSON schema (for the chat template)."""

    name: str
    fn: Callable
    schema: dict


@dataclass
class AgentContext:
    """What every agent loop of a run shares."""

    tokenizer: Any = None
    tools: dict[str, Tool] = field(default_factory=dict)
    max_turns: int = 4
    max_total_tokens: int = 1024
    tool_timeout_s: float = 10.0
    chat_template_kwargs: dict = field(default_factory=dict)

    @classmethod
    def from_rollout_config(cls, rollout, tokenizer, chat_template_kwargs: dict | None = None) -> AgentContext:
        return cls(
            tokenizer=tokenizer,
            tools=load_tools(rollout.tools),
            max_turns=rollout.agent_max_turns,
            max_total_tokens=rollout.agent_max_total_tokens,
            tool_timeout_s=rollout.tool_timeout_s,
            chat_template_kwargs=dict(chat_template_kwargs or {}),
        )


def resolve_spec(spec: str, field_name: str):
    module_name, sep, attr = str(spec).partition(":")
    if not sep or not module_name or not attr:
        raise AgentError(f"{field_name}={spec!r}; expected 'module:name' (e.g. moe_rl.rollout.tool_loop:ToolAgentLoop)")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise AgentError(f"{field_name}={spec!r}: cannot import {module_name!r} ({err})") from err
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise AgentError(f"{field_name}={spec!r}: {module_name!r} has no {attr!r}")
        obj = getattr(obj, part)
    return obj


AgentFn = Callable[[AgentSample, TurnGenerate], Awaitable[Trajectory]]


def load_agent(spec: str, context: AgentContext) -> AgentFn:
    """``rollout.agent``: a class (built once with ``context``; its async ``run(sample, generate)``) or an async
    function ``fn(sample, generate, context)``."""
    obj = resolve_spec(spec, "rollout.agent")
    if inspect.isclass(obj):
        loop = obj(context)
        if not inspect.iscoroutinefunction(getattr(loop, "run", None)):
            raise AgentError(f"rollout.agent={spec!r}: the class needs an `async def run(self, sample, generate)`")
        return loop.run
    if inspect.iscoroutinefunction(obj):
        return lambda sample, generate: obj(sample, generate, context)
    raise AgentError(f"rollout.agent={spec!r} is a {type(obj).__name__}; expected a class or an async function")


def tool_schema(fn: Callable) -> dict:
    """The OpenAI-style schema of ``fn`` (``transformers.utils.get_json_schema``: type hints and an ``Args:``
    docstring), or a bare one naming its parameters when the function does not document them."""
    try:
        return get_json_schema(fn)
    except Exception:  # noqa: BLE001 -- undocumented functions still register, with untyped parameters
        params = {name: {"type": "string"} for name in inspect.signature(fn).parameters}
        doc = (inspect.getdoc(fn) or fn.__name__).split("\n")[0]
        return {
            "type": "function",
            "function": {
                "name": fn.__name__,
                "description": doc,
                "parameters": {"type": "object", "properties": params, "required": list(params)},
            },
        }


def load_tools(specs: Sequence[str]) -> dict[str, Tool]:
    """``rollout.tools``: each ``module:function`` registered under the function's name (names must be unique)."""
    tools: dict[str, Tool] = {}
    for spec in specs or ():
        fn = resolve_spec(spec, "rollout.tools")
        if not callable(fn):
            raise AgentError(f"rollout.tools entry {spec!r} is not callable")
        if fn.__name__ in tools:
            raise AgentError(f"rollout.tools registers two tools named {fn.__name__!r}")
        tools[fn.__name__] = Tool(fn.__name__, fn, tool_schema(fn))
    return tools


async def run_agents(
    agent: AgentFn,
    samples: Sequence[AgentSample],
    client: RolloutClient,
    *,
    step: int = 0,
    rerender: str = "refuse",
    check_prefix_routes: bool = False,
    counters: PartialCounters | None = None,
) -> tuple[list[Trajectory], dict[str, int]]:
    """Every sample through ``agent`` concurrently; (trajectories in sample order, their summed counters).
    All or nothing, like the client's batch: the first failure cancels the rest and is raised. ``counters``: where
    the turns' ``async/*`` counts go (``TurnGenerate``). A trajectory whose generated tokens come from more than
    one weight version (async mode: an update between its turns, or inside one) counts in
    ``agent/multi_version_trajectories``."""

    async def one(sample: AgentSample) -> Trajectory:
        generate = TurnGenerate(
            client,
            step=step,
            index=sample.index,
            rerender=rerender,
            check_prefix_routes=check_prefix_routes,
            counters=counters,
        )
        out = await agent(sample, generate)
        if not isinstance(out, Trajectory):
            raise AgentError(f"the agent loop returned a {type(out).__name__}; expected a Trajectory")
        return out

    try:
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(one(s)) for s in samples]
    except* Exception as group:  # noqa: BLE001 -- re-raised: the first failure as itself, not as a group
        raise group.exceptions[0] from None
    trajectories = [t.result() for t in tasks]
    totals: Counter = Counter()
    for t in trajectories:
        totals.update(t.metrics)
        totals["agent/multi_version_trajectories"] += len(t.versions()) > 1
    return trajectories, dict(totals)
