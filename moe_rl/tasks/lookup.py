"""The lookup tool of the multi-turn example (``configs/agent_cpu.yaml``): boxes whose codes only the tool knows.

Owns the hidden table and the tool function registered by ``rollout.tools: [moe_rl.tasks.lookup:lookup]``. A box's
code is two digits taken from a SHA-256 of its number, so a model cannot compute it from the question: without
the tool it can only guess (1 in 100). ``scripts/make_agent_example.py`` writes the dataset's labels and the SFT
traces from the same function. Imports no other moe_rl package.
"""

from __future__ import annotations

import hashlib

__all__ = ["box_code", "lookup"]


def box_code(box: str) -> str:
    """The two-digit code stored in ``box`` (any text; the dataset's boxes are three digits)."""
    digest = hashlib.sha256(f"moe_rl box {str(box).strip()}".encode()).digest()
    return f"{int.from_bytes(digest[:8], 'big') % 100:02d}"


def lookup(box: str) -> str:
    """Look up the code stored in a box.

    Args:
        box: the box number, as written in the question
    """
    return box_code(box)
