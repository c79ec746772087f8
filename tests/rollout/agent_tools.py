"""Tools the agent-loop tests register through ``rollout.tools`` (``tests.rollout.agent_tools:<name>``)."""

from __future__ import annotations

import asyncio


def add(a: int, b: int) -> str:
    """Add two integers.

    Args:
        a: the first integer
        b: the second integer
    """
    return str(int(a) + int(b))


def fail(x: str) -> str:
    """Always raises (a tool error)."""
    raise RuntimeError(f"no such record {x!r}")


async def slow(x: str) -> str:
    """Never answers in time (a tool timeout); async, so the timeout cancels it and nothing is left running."""
    await asyncio.sleep(60)
    return x


def info(x: str) -> dict:
    """Returns a dict (non-text, JSON-able)."""
    return {"x": x, "n": 3}


def blob(x: str) -> object:
    """Returns an object that is not text and not JSON (non-text)."""
    return object()
