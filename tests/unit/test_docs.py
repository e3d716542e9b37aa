"""The docs say only what the software does: every `--flag` they give `gelastic`, `gelastic
SUB`, `coordinator serve` or `nodeagent` is one that program accepts; the JobSpec table lists
the public fields with their types and defaults; every skip marker gives its reason.

Flags are checked against the programs' own parser builders, in process. A flag counts when it
follows one of the program names on a command line of a shell, systemd or Kubernetes block, or
inside one inline code span. (The Python blocks are run by tests/e2e/test_docs.py.)
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from client import JobSpec
from client.cli import _parser as gelastic_parser
from coordinator.cli import _parser as coordinator_parser
from gelastic._cli_run import run_parser
from nodeagent.cli import _parser as nodeagent_parser
from tests._docs import DOCS, ROOT, all_blocks, blocks, inline_code

SHELL_LANGS = frozenset({"sh", "bash", "shell", "console", "ini", ""})


def _subparsers(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


@dataclass(frozen=True)
class Program:
    name: str
    parser: argparse.ArgumentParser
    stop_at_positional: bool
    """The first positional starts the job's own command line (its flags are not ours)."""


def _programs() -> tuple[argparse.ArgumentParser, dict[str, Program], Program, Program]:
    g = gelastic_parser()
    subs = {
        name: Program(f"gelastic {name}", sp, stop_at_positional=name == "submit")
        for name, sp in _subparsers(g).items()
    }
    subs["run"] = Program("gelastic run", run_parser(), stop_at_positional=True)
    serve = Program("coordinator serve", _subparsers(coordinator_parser())["serve"], False)
    agent = Program("nodeagent", nodeagent_parser(), False)
    return g, subs, serve, agent


GELASTIC, GELASTIC_SUBS, SERVE, AGENT = _programs()


def _takes_value(action: argparse.Action) -> bool:
    return action.nargs != 0


def _check_flags(program: Program, tokens: list[str], where: str) -> Iterator[str]:
    """Problems with the flags in `tokens` (what follows the program's name)."""
    options = program.parser._option_string_actions
    i = 0
    while i < len(tokens):
        token = tokens[i]
        i += 1
        if token == "--":
            return
        if token.startswith("--"):
            flag = token.split("=", 1)[0]
            action = options.get(flag)
            if action is None:
                yield f"{where}: `{program.name}` has no option {flag}"
                continue
            if _takes_value(action) and "=" not in token:
                i += 1
        elif not token.startswith("-") and program.stop_at_positional:
            return


def _check_command(tokens: list[str], where: str) -> Iterator[str]:
    """Find the programs in one command line's tokens and check what follows each."""
    i = 0
    while i < len(tokens):
        name = tokens[i].rsplit("/", 1)[-1]
        rest = tokens[i + 1 :]
        if name == "nodeagent":
            yield from _check_flags(AGENT, rest, where)
        elif name == "coordinator" and rest[:1] == ["serve"]:
            yield from _check_flags(SERVE, rest[1:], where)
        elif name == "gelastic":
            yield from _check_gelastic(rest, where)
        else:
            i += 1
            continue
        return


def _check_gelastic(tokens: list[str], where: str) -> Iterator[str]:
    options = GELASTIC._option_string_actions
    i = 0
    while i < len(tokens):
        token = tokens[i]
        i += 1
        if token.startswith("--"):
            flag = token.split("=", 1)[0]
            action = options.get(flag)
            if action is None:
                yield f"{where}: `gelastic` has no global option {flag}"
                continue
            if _takes_value(action) and "=" not in token:
                i += 1
            continue
        if token.startswith("-"):
            continue
        sub = GELASTIC_SUBS.get(token)
        if sub is None:
            return  # prose or a placeholder such as `gelastic COMMAND`: nothing to check
        yield from _check_flags(sub, tokens[i:], where)
        return


_STOP = frozenset({"|", "||", "&&", ";", ">", ">>", "<", "2>"})


def _command_lines(text: str) -> Iterator[tuple[int, list[str]]]:
    """(offset, tokens) of each command of a shell-like block, continuations joined."""
    joined: list[tuple[int, str]] = []
    pending = ""
    first = 0
    for n, line in enumerate(text.splitlines()):
        if not pending:
            first = n
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        joined.append((first, pending + line))
        pending = ""
    if pending:
        joined.append((first, pending))
    for n, line in joined:
        line = line.split("ExecStart=", 1)[-1]
        try:
            words = shlex.split(line, comments=True)
        except ValueError:
            words = line.split()
        tokens: list[str] = []
        for word in words:
            word = word.strip("[]")  # `[--attempt N]`: an optional part
            if word in _STOP:
                yield n, tokens
                tokens = []
            elif word:
                tokens.append(word)
        yield n, tokens


_YAML_COMMAND = re.compile(r"command:\s*\[([^\]]*)\]", re.S)


def _yaml_commands(text: str) -> Iterator[tuple[int, list[str]]]:
    for m in _YAML_COMMAND.finditer(text):
        items = [item.strip().strip("\"'") for item in m.group(1).split(",")]
        yield text.count("\n", 0, m.start()), [item for item in items if item]


def _problems() -> tuple[list[str], int]:
    problems: list[str] = []
    checked = 0
    for path in DOCS:
        for block in blocks(path):
            if block.lang in SHELL_LANGS:
                commands = _command_lines(block.text)
            elif block.lang == "yaml":
                commands = _yaml_commands(block.text)
            else:
                continue
            for offset, tokens in commands:
                where = f"{block.where}+{offset}"
                checked += 1
                problems += _check_command(tokens, where)
        for span in inline_code(path):
            if not re.search(r"\b(gelastic|nodeagent|coordinator serve)\b", span):
                continue
            try:
                tokens = shlex.split(span)
            except ValueError:
                tokens = span.split()
            checked += 1
            problems += _check_command(
                [t.strip("[]") for t in tokens], f"{path.relative_to(ROOT)}: `{span}`"
            )
    return problems, checked


def test_every_flag_the_docs_give_a_program_exists() -> None:
    problems, checked = _problems()
    assert checked > 50, f"only {checked} command lines found: is the extraction broken?"
    assert not problems, "\n".join(problems)


def _migration_table_problems() -> tuple[list[str], int]:
    """The `gelastic run` and `gelastic submit` columns of torchrun-migration.md's table."""
    text = (ROOT / "docs" / "torchrun-migration.md").read_text()
    header = "| torchrun | `gelastic run` | `gelastic submit` | `JobSpec` field |"
    assert header in text
    table = text.split(header, 1)[1].split("\n\n", 1)[0]
    columns = ((1, GELASTIC_SUBS["run"]), (2, GELASTIC_SUBS["submit"]))
    problems: list[str] = []
    checked = 0
    for line in table.splitlines()[1:]:
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        for column, program in columns:
            for span in re.findall(r"`([^`]+)`", cells[column]):
                if re.search(r"\b(gelastic|nodeagent|coordinator)\b", span):
                    continue  # a whole command line: checked with the others
                flag = span.split()[0].split("=", 1)[0]
                if not flag.startswith("-") or flag == "--":
                    continue
                checked += 1
                if flag not in program.parser._option_string_actions:
                    problems.append(f"torchrun-migration.md: `{program.name}` has no {flag}")
    return problems, checked


def test_the_torchrun_table_names_real_flags() -> None:
    problems, checked = _migration_table_problems()
    assert checked > 20, checked
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    ("line", "bad"),
    [
        ("gelastic --coordinator h:1 submit --nnodes 2 --bogus -- python t.py --lr 1", "--bogus"),
        ("nodeagent --coordinator h:1 --no-such-flag", "--no-such-flag"),
        ("/opt/gelastic/bin/coordinator serve --host 0.0.0.0 --nope 3", "--nope"),
        ("gelastic logs JOB --rank 3 [--folow]", "--folow"),
        ("gelastic --nope jobs", "--nope"),
    ],
)
def test_the_checker_finds_a_wrong_flag(line: str, bad: str) -> None:
    ((_, tokens),) = list(_command_lines(line))
    problems = list(_check_command(tokens, "here"))
    assert len(problems) == 1 and bad in problems[0], problems


def test_the_checker_leaves_the_jobs_own_flags_alone() -> None:
    for line in (
        "gelastic run --nproc-per-node 4 --max-restarts 2 train.py --lr 0.1",
        "gelastic --coordinator head:29400 submit --nnodes 2:4 --watch -- python train.py --lr 1",
        "gelastic logs JOB --rank 3 --stream stderr --json -f",
    ):
        ((_, tokens),) = list(_command_lines(line))
        assert list(_check_command(tokens, "here")) == []


def _jobspec_table() -> list[list[str]]:
    text = (ROOT / "docs" / "python-api.md").read_text()
    section = text.split("## `JobSpec`", 1)[1].split("\n#", 1)[0]
    rows = []
    for line in section.splitlines():
        if line.startswith("| `"):
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
            rows.append([c.replace("\\|", "|") for c in cells])
    return rows


def test_the_jobspec_table_matches_the_dataclass() -> None:
    rows = _jobspec_table()
    public = [f for f in dataclasses.fields(JobSpec) if f.repr]
    assert [r[0].strip("`") for r in rows] == [f.name for f in public]
    defaults = JobSpec()
    for (_, type_cell, default_cell, meaning), f in zip(rows, public, strict=True):
        assert type_cell.strip("`") == f.type, f.name
        assert meaning, f.name
        if default_cell.startswith("—"):
            assert f.name == "entrypoint"
            continue
        documented = ast.literal_eval(default_cell.strip("`"))
        actual = getattr(defaults, f.name)
        assert documented == actual and type(documented) is type(actual), (
            f"{f.name}: the docs say {default_cell}, the code has {actual!r}"
        )
    hidden = {f.name for f in dataclasses.fields(JobSpec) if not f.repr}
    assert hidden == {"function", "function_args", "result_key"}
    spec = JobSpec(entrypoint="pkg.mod:fn", function_args=b"secret-args", result_key=b"k" * 32)
    assert "function_args" not in repr(spec) and "secret-args" not in repr(spec)
    assert "entrypoint='pkg.mod:fn'" in repr(spec)


def test_every_skip_marker_gives_its_reason() -> None:
    bad = [f"{b.where}: {b.bad_marker}" for b in all_blocks() if b.bad_marker]
    assert not bad, "markers must read <!-- docs-test: skip (REASON) -->:\n" + "\n".join(bad)
    for b in all_blocks():
        if b.skip is not None:
            assert b.lang == "python", f"{b.where}: only Python blocks run, nothing to skip"


def test_spec_error_is_a_gelastic_error_and_a_value_error() -> None:
    # docs/python-api.md: either `except` catches it; nothing was sent, so no status code.
    from client import GelasticError, SpecError

    with pytest.raises(GelasticError) as caught:
        JobSpec(entrypoint=["python"], nproc_per_node=0).validate()
    assert isinstance(caught.value, SpecError) and isinstance(caught.value, ValueError)
    assert caught.value.code is None and caught.value.field == "nproc_per_node"
    with pytest.raises(ValueError, match="nproc_per_node: must be between 1 and 4096"):
        JobSpec(entrypoint=["python"], nproc_per_node=0).validate()


_HOP = re.compile(r"\d+\. (.*)")
_PY_FILE = re.compile(r"[a-z_]+(?:/[a-z_]+)*\.py")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*")


def _reading_the_code() -> list[str]:
    text = (ROOT / "docs" / "concepts.md").read_text()
    section = text.split("\n## Reading the code\n", 1)[1].split("\n## ", 1)[0]
    return [m.group(1) for line in section.splitlines() if (m := _HOP.fullmatch(line))]


def test_the_reading_the_code_hops_name_files_and_names_that_exist() -> None:
    # docs/concepts.md walks a submit and an exit hop by hop: each file it names must exist,
    # and each name a hop gives (a function, a class, a message) must be in one of its files.
    hops = _reading_the_code()
    assert len(hops) >= 20, hops
    wrong = []
    for hop in hops:
        spans = re.findall(r"`([^`\n]+)`", hop)
        files = [s for s in spans if _PY_FILE.fullmatch(s)]
        assert files, f"a hop names no file: {hop}"
        texts = []
        for f in files:
            path = ROOT / f
            if not path.is_file():
                wrong.append(f"{f}: no such file ({hop[:60]})")
                continue
            texts.append(path.read_text())
        for name in (s for s in spans if s not in files and _NAME.fullmatch(s)):
            last = name.rsplit(".", 1)[-1]
            if not any(re.search(rf"\b{re.escape(last)}\b", t) for t in texts):
                wrong.append(f"{name}: in none of {files} ({hop[:60]})")
    assert not wrong, "\n".join(wrong)
