"""Rooms stay small: no module, class or function of coordinator/, nodeagent/, client/ (and
gelastic/) grows past its limit.

Parses every module of our packages (ast only, nothing is imported; the generated
`*_pb2*.py` aside) and fails on a module over 800 lines, a class over 400 lines, or a function
over 80 statements (the `ast.stmt` nodes inside it, nested ones included). A room that big is a
sign that two concerns share it: split it along the concern, not by line count.

What is over a limit today is listed in TOO_BIG_TODAY at its size today. A listed room may shrink
but never grow past its entry, so the list only shrinks: lower an entry as its room shrinks, and
remove it once the room is within its limit (until then a stale entry passes, silently).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("coordinator", "nodeagent", "client", "gelastic")

LIMITS = {"module": 800, "class": 400, "function": 80}
"""The most a room of each kind may hold: lines of a module or class, statements of a function."""
UNITS = {"module": "lines", "class": "lines", "function": "statements"}

TOO_BIG_TODAY: dict[str, int] = {}
"""Rooms over their limit today -> their size today ("path" for a module, "path:Qualified.name"
for a class or function). Only ever lower an entry or remove it."""


@dataclass(frozen=True)
class Room:
    """A module, class or function, and how much it holds."""

    key: str
    kind: str
    size: int

    def describe(self) -> str:
        return f"{self.key}: a {self.kind} of {self.size} {UNITS[self.kind]}"


def _statements(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    return sum(isinstance(n, ast.stmt) for n in ast.walk(node)) - 1  # not the def itself


def rooms(path: str, source: str) -> Iterator[Room]:
    """The module at `path` (relative, with /) and every class and function in it, at any depth."""
    yield Room(path, "module", len(source.splitlines()))

    def inside(parent: ast.AST, prefix: str) -> Iterator[Room]:
        for node in ast.iter_child_nodes(parent):
            if isinstance(node, ast.ClassDef):
                name = prefix + node.name
                assert node.end_lineno is not None
                yield Room(f"{path}:{name}", "class", node.end_lineno - node.lineno + 1)
                yield from inside(node, name + ".")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + node.name
                yield Room(f"{path}:{name}", "function", _statements(node))
                yield from inside(node, name + ".")
            else:
                yield from inside(node, prefix)

    yield from inside(ast.parse(source, filename=path), "")


def too_big(found: Iterable[Room], listed: Mapping[str, int]) -> list[str]:
    """One line for each room over its limit that is not listed, or has grown past its entry."""
    problems = []
    for room in found:
        limit = LIMITS[room.kind]
        if room.size <= limit:
            continue
        allowed = listed.get(room.key)
        if allowed is None:
            problems.append(
                f"{room.describe()}, over the {limit} allowed: split it along its concerns,"
                f" each in a {room.kind} of its own"
            )
        elif room.size > allowed:
            problems.append(
                f"{room.describe()}, grown past the {allowed} it is listed at in TOO_BIG_TODAY"
                f" (limit {limit}): split it rather than grow it; the list only shrinks"
            )
    return problems


def _package_modules() -> Iterator[Path]:
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if "_pb2" not in path.name:
                yield path


def test_no_module_class_or_function_grows_past_its_limit() -> None:
    found = [
        room
        for path in _package_modules()
        for room in rooms(path.relative_to(ROOT).as_posix(), path.read_text())
    ]
    assert len({r.key for r in found if r.kind == "module"}) > 20, "the packages were not found"
    problems = too_big(found, TOO_BIG_TODAY)
    if problems:
        pytest.fail("rooms too big:\n" + "\n".join(f"  {p}" for p in problems), pytrace=False)


def _source(module_lines: int, class_lines: int, function_statements: int) -> str:
    """A module of `module_lines` lines: class C of `class_lines` lines, whose method f holds
    `function_statements` statements."""
    body = [f"        x{i} = {i}" for i in range(function_statements)]
    cls = ["class C:", "    def f(self):", *body]
    cls += [f"    y{i} = {i}" for i in range(class_lines - len(cls))]
    return "\n".join(cls + [f"z{i} = {i}" for i in range(module_lines - len(cls))]) + "\n"


def test_each_kind_of_room_is_measured_and_held_to_its_limit() -> None:
    at_limits = list(rooms("p/m.py", _source(800, 400, 80)))
    assert {(r.key, r.kind, r.size) for r in at_limits} == {
        ("p/m.py", "module", 800),
        ("p/m.py:C", "class", 400),
        ("p/m.py:C.f", "function", 80),
    }
    assert too_big(at_limits, {}) == []
    over = list(rooms("p/m.py", _source(801, 401, 81)))
    problems = too_big(over, {})
    assert len(problems) == 3
    for problem, named in zip(
        problems,
        (
            "p/m.py: a module of 801 lines",
            "p/m.py:C: a class of 401 lines",
            "p/m.py:C.f: a function of 81 statements",
        ),
        strict=True,
    ):
        assert problem.startswith(named + ", over the ") and "split it" in problem, problem


def test_a_listed_room_may_shrink_but_not_grow() -> None:
    over = list(rooms("p/m.py", _source(900, 450, 90)))
    listed = {"p/m.py": 900, "p/m.py:C": 450, "p/m.py:C.f": 90}
    assert too_big(over, listed) == []
    # Shrunk, even below the limit: the stale entries pass.
    assert too_big(list(rooms("p/m.py", _source(10, 5, 1))), listed) == []
    grown = too_big(list(rooms("p/m.py", _source(901, 451, 91))), listed)
    assert [p.split(",")[0] for p in grown] == [
        "p/m.py: a module of 901 lines",
        "p/m.py:C: a class of 451 lines",
        "p/m.py:C.f: a function of 91 statements",
    ]
    assert all("grown past the" in p and "split it" in p for p in grown), grown
