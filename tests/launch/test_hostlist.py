"""SLURM hostlist expansion: the node names every launch plan is built from."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from moe_rl.launch import HostlistError, expand_hostlist


@pytest.mark.parametrize(
    ("expr", "expected"),
    [
        ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
        ("a1,b[8-10]", ["a1", "b8", "b9", "b10"]),  # unpadded lower bound: no padding
        ("gpu[098-101]", ["gpu098", "gpu099", "gpu100", "gpu101"]),
        ("r[1-2]-n[01-02]", ["r1-n01", "r1-n02", "r2-n01", "r2-n02"]),  # groups multiply, left to right
        ("login-ib0", ["login-ib0"]),
        (" x[3],y ", ["x3", "y"]),
    ],
)
def test_hostlist_expands_like_scontrol(expr, expected):
    assert expand_hostlist(expr) == expected


@pytest.mark.parametrize(
    ("expr", "needle"),
    [
        ("node[04-01]", "descending"),
        ("node[01-03", "unclosed"),
        ("node01]", "unbalanced"),
        ("node[1,1]", "twice"),
        ("", "empty hostlist"),
        ("a,,b", "empty host"),
        ("node[a-b]", "bad range"),
        ("n[[1]]", "nested"),
    ],
)
def test_malformed_hostlist_is_refused_with_the_reason(expr, needle):
    with pytest.raises(HostlistError, match=needle):
        expand_hostlist(expr)


_prefix = st.text(alphabet="abcdefgh-", min_size=1, max_size=6).filter(lambda s: not s[-1].isdigit())


@given(
    prefix=_prefix,
    width=st.integers(1, 4),
    runs=st.lists(st.tuples(st.integers(0, 30), st.integers(1, 5)), min_size=1, max_size=4),
)
def test_hostlist_of_disjoint_ranges_matches_zfill_enumeration(prefix, width, runs):
    # Build disjoint ascending runs, write them the way SLURM compresses, expand, compare with zfill.
    parts, expected, cursor = [], [], 0
    for gap, length in runs:
        lo = cursor + gap
        hi = lo + length - 1
        cursor = hi + 2
        parts.append(str(lo).zfill(width) + ("" if lo == hi else "-" + str(hi).zfill(width)))
        expected += [prefix + str(n).zfill(width) for n in range(lo, hi + 1)]
    assert expand_hostlist(f"{prefix}[{','.join(parts)}]") == expected
