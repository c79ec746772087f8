"""Small gathers stay small: every object collective in moe_rl/ says how big its payload can get.

``torch.distributed.gather_object`` pads every rank's pickled payload to the largest and allocates largest x world
on the destination's device; ``broadcast_object_list`` / ``all_gather_object`` pickle whatever they are handed. So
each use in the package (and each ``RankComm`` gather/broadcast, which pickles too) carries a ``# size: ...``
comment on its line or on the comment lines just above it, saying what bounds its payload, and the one use whose
payload is the whole model (``global_state.gather_stages``, the test oracle) is called from nowhere but
``export_hf_state_dict``, itself called by no module of the package.
"""

from __future__ import annotations

import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "moe_rl"
OBJECT_COLLECTIVE = re.compile(
    r"\b(gather_object|broadcast_object_list|all_gather_object)\(|\bcomm\.(gather|bcast)\(|RankComm\([^)]*\)\.(gather|bcast)\("
)


def unbounded_uses(text: str) -> list[int]:
    """1-based line numbers of object collectives without a ``# size:`` comment on the line or just above it."""
    lines = text.splitlines()
    bad = []
    for i, line in enumerate(lines):
        if not OBJECT_COLLECTIVE.search(line.split("#")[0]) or line.lstrip().startswith(("def ", '"', "#")):
            continue
        if "# size:" in line:
            continue
        j = i - 1
        while j >= 0 and lines[j].lstrip().startswith("#"):
            if "# size:" in lines[j]:
                break
            j -= 1
        else:
            bad.append(i + 1)
            continue
        if j < 0 or "# size:" not in lines[j]:
            bad.append(i + 1)
    return bad


def test_every_object_collective_states_its_size_bound():
    bad = [
        f"{path.relative_to(PACKAGE.parent)}:{n}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for n in unbounded_uses(path.read_text())
    ]
    assert not bad, f"object collectives without a '# size: ...' bound comment: {bad}"


def test_the_check_itself_sees_a_bare_gather_object():
    bare = "x = 1\nparts = [None] * 2\ndist.gather_object(state, parts, dst=0)\n"
    assert unbounded_uses(bare) == [3]
    commented = (
        "# size: one flag per rank\n# (gloo)\ndist.gather_object(ok, parts, dst=0)\ncomm.bcast(v)  # size: a path\n"
    )
    assert unbounded_uses(commented) == []


def test_the_whole_model_gather_is_the_test_oracle_only():
    users = {
        str(p.relative_to(PACKAGE.parent))
        for p in PACKAGE.rglob("*.py")
        if re.search(r"\bgather_stages\(", p.read_text()) and p.name != "global_state.py"
    }
    assert users == {"moe_rl/learner/hf_convert.py"}, users
    callers = [
        str(p.relative_to(PACKAGE.parent))
        for p in PACKAGE.rglob("*.py")
        if re.search(r"(?<!def )\bexport_hf_state_dict\(", p.read_text())
    ]
    assert callers == [], f"the whole-model oracle export_hf_state_dict is called by {callers}"
