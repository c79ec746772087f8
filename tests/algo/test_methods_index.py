"""docs/methods.md against the survey's method table (issue 54): one row per method, each selectable or said not to be.

The fixture ``survey_methods.json`` holds the 48 method names of seed 000's comparison table ("A comparison
map of all methods"), in its order, with the seed file's name and sha256. Every name must have a row in
docs/methods.md whose moe_rl cell either gives ``section.key=value`` overrides that ``load_config`` accepts
on configs/tiny_cpu.yaml (each one on its own; no preflight, no server) or says "not applicable: why" /
"not yet". Links from the page into docs/*.md must name a heading that exists (GitHub's anchor rule).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import pytest

from moe_rl.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = Path(__file__).with_name("survey_methods.json")
METHODS_MD = ROOT / "docs" / "methods.md"
TINY = ROOT / "configs" / "tiny_cpu.yaml"
OVERRIDE = re.compile(r"`([a-z_]+(?:\.[a-z_0-9]+)+)=([^`]+)`")
LINK = re.compile(r"\]\(([a-z_]+\.md)(?:#([^)]*))?\)")


def _fixture() -> dict:
    return json.loads(FIXTURE.read_text(encoding="utf-8"))


def _rows(text: str) -> list[tuple[str, str]]:
    """(method, moe_rl cell) of each numbered table row, in page order."""
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if line.startswith("| ") and len(cells) == 5 and cells[0].isdigit():
            rows.append((cells[1], cells[3]))
    return rows


def _cell_problems(cell: str) -> list[str]:
    """Why a moe_rl cell does not select the method nor say why it cannot; [] when it is fine."""
    overrides = [f"{key}={value}" for key, value in OVERRIDE.findall(cell)]
    if not overrides:
        if "not applicable: " in cell or "not yet" in cell:
            return []
        return ["no `section.key=value` and neither 'not applicable: why' nor 'not yet'"]
    problems = []
    for item in overrides:
        try:
            load_config(TINY, [item])
        except ConfigError as exc:
            problems.append(f"`{item}`: {exc}")
    return problems


def _index_problems(names: list[str], text: str) -> list[str]:
    rows = _rows(text)
    cells = dict(rows)
    problems = [f"{name!r}: no row in docs/methods.md" for name in names if name not in cells]
    problems += [f"row {m!r} is not a method of the survey's table" for m, _ in rows if m not in names]
    if not problems and [m for m, _ in rows] != names:
        problems.append("docs/methods.md rows are not in the survey's order")
    for name in names:
        problems += [f"{name!r}: {p}" for p in _cell_problems(cells.get(name, "not yet"))]
    return problems


def _slug(heading: str) -> str:
    """GitHub's heading anchor: lower case, punctuation other than '-' and '_' dropped, spaces -> '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_fixture_holds_the_48_methods():
    fx = _fixture()
    assert fx["count"] == 48
    assert len(fx["methods"]) == 48
    assert len(set(fx["methods"])) == 48
    assert re.fullmatch(r"[0-9a-f]{64}", fx["seed_sha256"])


def test_fixture_matches_the_seed_table():
    fx = _fixture()
    dirs = [os.environ.get("MOE_RL_SEEDS_DIR", ""), ROOT.parent / "shared" / "seeds", "/work/shared/seeds"]
    seed = next((Path(d) / fx["seed_file"] for d in dirs if d and (Path(d) / fx["seed_file"]).is_file()), None)
    if seed is None:
        pytest.skip(f"seed {fx['seed_file']} not found (set MOE_RL_SEEDS_DIR); the committed fixture is used")
    data = seed.read_bytes()
    assert hashlib.sha256(data).hexdigest() == fx["seed_sha256"]
    lines = data.decode("utf-8").splitlines()
    start = lines.index(fx["section"]) + 4  # title, blank, sentence, blank, header row
    assert lines[start].startswith("Method")
    table = lines[start + 1 : lines.index("", start)]
    assert len(table) == 48
    for name, line in zip(fx["methods"], table, strict=True):
        assert line.startswith(name), (name, line[:40])


def test_every_method_has_a_row_that_selects_it_or_says_why_not():
    problems = _index_problems(_fixture()["methods"], METHODS_MD.read_text(encoding="utf-8"))
    assert not problems, "docs/methods.md:\n" + "\n".join(problems)


def test_the_check_fails_on_a_missing_row_and_a_made_up_key():
    names = _fixture()["methods"]
    text = METHODS_MD.read_text(encoding="utf-8")
    without = "\n".join(line for line in text.splitlines() if not line.startswith("| 8 | GSPO |"))
    assert _index_problems(names, without) == ["'GSPO': no row in docs/methods.md"]
    made_up = text.replace("`loss.type=gspo`", "`loss.gspo_tau=1.0`", 1)
    (problem,) = _index_problems(names, made_up)
    assert problem.startswith("'GSPO': `loss.gspo_tau=1.0`") and "unknown key 'loss.gspo_tau'" in problem
    bad_value = text.replace("`loss.type=gspo`", "`loss.type=made_up_loss`", 1)
    (problem,) = _index_problems(names, bad_value)
    assert "loss.type='made_up_loss' is not allowed" in problem
    bare = text.replace("| not yet (issue 54) |", "| TBD |", 1)
    assert _index_problems(names, bare) == [
        "'R²VPO': no `section.key=value` and neither 'not applicable: why' nor 'not yet'"
    ]


def test_links_name_existing_sections():
    text = METHODS_MD.read_text(encoding="utf-8")
    missing = []
    for doc, anchor in set(LINK.findall(text)):
        target = ROOT / "docs" / doc
        assert target.is_file(), f"docs/methods.md links to missing docs/{doc}"
        if anchor:
            lines = target.read_text(encoding="utf-8").splitlines()
            slugs = {_slug(line.lstrip("#")) for line in lines if line.startswith("#")}
            if anchor not in slugs:
                missing.append(f"{doc}#{anchor}")
    assert not missing, f"docs/methods.md links to headings that do not exist: {sorted(missing)}"
