"""docs/torchelastic-parity.md: every row says same, different (why) or not supported (why), every
"same" row names the tests that prove it, and every test named exists (its file, and a function
of that name at the file's top level). Parsed with ast: nothing is imported."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TABLE = ROOT / "docs" / "torchelastic-parity.md"
MAX_TABLE_BYTES = 256 * 1024

_TEST_REF = re.compile(r"tests/[A-Za-z0-9_/]{1,200}\.py::test_[A-Za-z0-9_]{1,200}")
_STATUS = re.compile(r"same|different \(.+\)|not supported \(.+\)|not supported yet \(.+\)")
CONCEPTS = (
    "WorkerSpec",
    "WorkerState",
    "WorkerGroup",
    "RunResult",
    "Rendezvous",
    "Restarts",
    "Membership",
    "monitor_interval",
    "Exit barrier",
    "Health",
    "Watchdog",
    "Events",
    "Metrics",
    "Error files",
    "`record`",
    "ChildFailedError",
    "ProcessFailure",
    "categories",
    "Env vars",
    "Extension points",
)
"""What torchelastic's agent and error docs describe: each is in some row's first column."""


@dataclass(frozen=True)
class Row:
    line: int
    concept: str
    status: str
    tests: tuple[str, ...]


def parse(text: str) -> list[Row]:
    """The table's rows (header and rule aside); ValueError for a row without five cells."""
    rows: list[Row] = []
    lines = text.splitlines()
    table = [(n, line) for n, line in enumerate(lines, 1) if line.startswith("|")]
    for n, line in table[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 5:
            raise ValueError(f"line {n}: {len(cells)} cells, not 5")
        refs = tuple(r.strip() for r in cells[4].split(",") if r.strip())
        rows.append(Row(n, cells[0], cells[3], refs))
    return rows


@cache
def _functions(path: Path) -> frozenset[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef)
    return frozenset(node.name for node in tree.body if isinstance(node, kinds))


def problems(rows: list[Row]) -> list[str]:
    """What is wrong with the rows: a bad status, a "same" without tests, a test that is not."""
    found: list[str] = []
    for row in rows:
        where = f"line {row.line} ({row.concept})"
        if not _STATUS.fullmatch(row.status):
            found.append(f"{where}: status {row.status!r} is not same/different (why)/...")
        if row.status == "same" and not row.tests:
            found.append(f"{where}: a 'same' row names no test")
        for ref in row.tests:
            if not _TEST_REF.fullmatch(ref):
                found.append(f"{where}: {ref!r} is not tests/path.py::test_name")
                continue
            file, _, name = ref.partition("::")
            path = ROOT / file
            if not path.is_file():
                found.append(f"{where}: no file {file}")
            elif name not in _functions(path):
                found.append(f"{where}: {file} has no test {name}")
    return found


def test_every_row_has_a_status_and_every_test_named_exists() -> None:
    assert TABLE.stat().st_size <= MAX_TABLE_BYTES
    rows = parse(TABLE.read_text(encoding="utf-8"))
    assert len(rows) >= len(CONCEPTS)
    assert problems(rows) == []


@pytest.mark.parametrize("concept", CONCEPTS)
def test_each_concept_of_torchelastic_has_a_row(concept: str) -> None:
    rows = parse(TABLE.read_text(encoding="utf-8"))
    assert any(concept.lower() in row.concept.lower() for row in rows), concept


@pytest.mark.parametrize(
    ("cells", "problem"),
    [
        ("| x | a | b | same | |", "names no test"),
        ("| x | a | b | same | tests/unit/test_ranks.py::test_no_such_test |", "has no test"),
        ("| x | a | b | same | tests/unit/no_such_file.py::test_x |", "no file"),
        ("| x | a | b | same | test_ranks.py::test_single_node |", "is not tests/path.py"),
        ("| x | a | b | different | |", "is not same/different"),
        ("| x | a | b | mostly | |", "is not same/different"),
    ],
)
def test_the_checker_finds_what_is_wrong(cells: str, problem: str) -> None:
    text = "| a | b | c | d | e |\n|---|---|---|---|---|\n" + cells
    (found,) = problems(parse(text))
    assert problem in found


def test_the_checker_passes_a_right_row() -> None:
    text = "| a | b | c | d | e |\n|---|---|---|---|---|\n"
    text += "| x | a | b | same | tests/unit/test_ranks.py::test_single_node |"
    assert problems(parse(text)) == []
