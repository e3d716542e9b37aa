"""`gelastic run` checks that what it is to run is there before it starts anything.

Before, `gelastic run nosuch.py` started the coordinator, the agent and every worker, and only
then failed each with `can't open file ...`, exit 1.
"""

from __future__ import annotations

import os
from pathlib import Path
from unittest import mock

import pytest

from gelastic import _cli_run, cli


@pytest.fixture
def here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PYTHON_EXEC", raising=False)
    return tmp_path


def _run(capfd: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    # Nothing may start: an embedded cluster would be a bug here.
    with mock.patch.object(_cli_run, "EmbeddedCluster", side_effect=AssertionError("started")):
        code = cli.main(["run", *argv])
    out, err = capfd.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["nosuch.py"], "cannot run nosuch.py: no such file in {here}"),
        (["--nproc-per-node", "2", "sub/nosuch.py", "--lr", "1"], "cannot run sub/nosuch.py: "),
        (
            ["-m", "nosuch_pkg.train"],
            "cannot run -m nosuch_pkg.train: no module named 'nosuch_pkg.train' in {here} "
            "or the interpreter's path",
        ),
        (["-m", "pkg.nosuch"], "cannot run -m pkg.nosuch: no module named 'pkg.nosuch'"),
        (["--no-python", "nosuch-trainer"], "cannot run nosuch-trainer (--no-python): not found"),
        (
            ["--no-python", "train.sh"],
            "cannot run train.sh (--no-python): not found in PATH; ./train.sh runs the one in "
            "this directory",
        ),
        (
            ["--no-python", "./bin/nosuch"],
            "cannot run ./bin/nosuch (--no-python): no executable file at {here}/bin/nosuch",
        ),
        (["--no-python", "./plain.txt"], "cannot run ./plain.txt (--no-python): no executable"),
    ],
)
def test_what_is_not_there_is_one_line_and_exit_2(
    here: Path, capfd: pytest.CaptureFixture[str], argv: list[str], line: str
) -> None:
    (here / "pkg").mkdir()
    (here / "pkg" / "__init__.py").write_text("")
    (here / "train.sh").write_text("#!/bin/sh\n")
    (here / "train.sh").chmod(0o755)
    (here / "plain.txt").write_text("")
    code, out, err = _run(capfd, *argv)
    assert code == 2, (out, err)
    assert out == ""
    (shown,) = err.splitlines()
    assert shown.startswith("gelastic run: " + line.format(here=here)), shown


def test_what_is_there_passes_the_check(here: Path) -> None:
    (here / "train.py").write_text("")
    (here / "pkg").mkdir()
    (here / "pkg" / "__init__.py").write_text("")
    (here / "pkg" / "train.py").write_text("")
    (here / "app").mkdir()
    (here / "app" / "__main__.py").write_text("")
    (here / "run.sh").write_text("#!/bin/sh\n")
    (here / "run.sh").chmod(0o755)
    parser = _cli_run.run_parser()
    for argv in (
        ["train.py"],
        [str(here / "train.py")],
        ["app"],
        ["-m", "pkg.train"],
        ["-m", "json.tool"],
        ["--no-python", "./run.sh"],
        ["--no-python", "sh"],
        ["--run-path", "train.py"],
    ):
        plan = _cli_run.plan_run(parser.parse_args(argv))
        assert plan.spec.entrypoint, argv
    # Another interpreter has a path of its own: its modules are its business.
    with mock.patch.dict(os.environ, {"PYTHON_EXEC": "/opt/other/python3"}):
        assert _cli_run.plan_run(parser.parse_args(["-m", "only_there"])).spec.entrypoint
