"""Expand SLURM hostlist expressions (``node[01-04,07],gpu-a``) into host names.

Owns the pure string expansion that ``scontrol show hostnames`` performs, so a launch plan can be
rendered and tested without SLURM installed. It must not read the environment or run commands.
"""

from __future__ import annotations

import itertools
import re

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


class HostlistError(ValueError):
    """A hostlist expression that SLURM would not produce; the message quotes it."""


def _split_top_level(expr: str) -> list[str]:
    """Split on commas that are outside brackets: ``a[1,2],b`` -> ``['a[1,2]', 'b']``."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(expr):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise HostlistError(f"nested '[' at position {i} in hostlist {expr!r}")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise HostlistError(f"unbalanced ']' at position {i} in hostlist {expr!r}")
        elif ch == "," and depth == 0:
            items.append(expr[start:i])
            start = i + 1
    if depth:
        raise HostlistError(f"unclosed '[' in hostlist {expr!r}")
    items.append(expr[start:])
    return items


def _expand_ranges(body: str, expr: str) -> list[str]:
    """``01-03,07`` -> ``['01', '02', '03', '07']``; width of each range = width of its lower bound."""
    out: list[str] = []
    for part in body.split(","):
        m = _RANGE.match(part.strip())
        if m is None:
            raise HostlistError(f"bad range {part!r} in hostlist {expr!r}; expected N or N-M with digits")
        lo_s, hi_s = m.group(1), m.group(2) or m.group(1)
        lo, hi = int(lo_s), int(hi_s)
        if lo > hi:
            raise HostlistError(f"descending range {part!r} in hostlist {expr!r}")
        # SLURM zero-pads every number of a range to the width written for its lower bound.
        out.extend(f"{n:0{len(lo_s)}d}" for n in range(lo, hi + 1))
    return out


def _expand_item(item: str, expr: str) -> list[str]:
    """One host pattern, possibly with several bracket groups (cartesian product, left to right)."""
    pieces = re.split(r"(\[[^\]]*\])", item)
    choices = [_expand_ranges(p[1:-1], expr) if p.startswith("[") else [p] for p in pieces]
    return ["".join(combo) for combo in itertools.product(*choices)]


def expand_hostlist(expr: str) -> list[str]:
    """Host names of a SLURM hostlist, in SLURM's order: ``node[01-02],x`` -> ``[node01, node02, x]``.

    Raises ``HostlistError`` for empty items, malformed or descending ranges and duplicate hosts
    (a duplicate would put two roles on one node).
    """
    expr = expr.strip()
    if not expr:
        raise HostlistError("empty hostlist; expected e.g. 'node[01-04]'")
    hosts: list[str] = []
    for item in _split_top_level(expr):
        item = item.strip()
        if not item:
            raise HostlistError(f"empty host name in hostlist {expr!r}")
        hosts.extend(_expand_item(item, expr))
    seen: set[str] = set()
    for host in hosts:
        if host in seen:
            raise HostlistError(f"host {host!r} appears twice in hostlist {expr!r}")
        seen.add(host)
    return hosts
