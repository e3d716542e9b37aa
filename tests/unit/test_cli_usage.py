"""A mistyped flag, as a user sees it: the `gelastic` CLI as a subprocess, its stderr and exit code.

Usage errors are found before any connection, so no coordinator is needed.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

CALL_TIMEOUT = 30


def gelastic(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gelastic", *args],
        capture_output=True,
        text=True,
        timeout=CALL_TIMEOUT,
    )


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        # Before: "gelastic: unrecognized arguments: --nprocs-per-node (see 'gelastic --help')".
        (
            ["submit", "--nprocs-per-node", "2", "--", "true"],
            "gelastic submit: unrecognized arguments: --nprocs-per-node; did you mean "
            "--nproc-per-node? (see 'gelastic submit --help')",
        ),
        (
            ["jobs", "--actve"],
            "gelastic jobs: unrecognized arguments: --actve; did you mean --active? "
            "(see 'gelastic jobs --help')",
        ),
        (
            ["logs", "JOB", "--folow"],
            "gelastic logs: unrecognized arguments: --folow; did you mean --follow? "
            "(see 'gelastic logs --help')",
        ),
        (
            ["cancel", "JOB", "--zzz"],
            "gelastic cancel: unrecognized arguments: --zzz (see 'gelastic cancel --help')",
        ),
        # Before: "gelastic: argument COMMAND: invalid choice: '127.0.0.1:29400' (choose from ...".
        (
            ["--coordnator", "127.0.0.1:29400", "jobs"],
            "gelastic: unrecognized option --coordnator; did you mean --coordinator? "
            "(see 'gelastic --help')",
        ),
        (
            ["--coordnator=127.0.0.1:29400", "jobs"],
            "gelastic: unrecognized option --coordnator; did you mean --coordinator? "
            "(see 'gelastic --help')",
        ),
    ],
)
def test_a_mistyped_flag_names_the_command_its_help_and_the_closest_flag(
    argv: list[str], said: str
) -> None:
    r = gelastic(*argv)
    assert r.returncode == 2, r.stderr
    assert r.stderr == said + "\n"
    assert r.stdout == ""


def test_global_options_before_the_command_still_parse() -> None:
    # Known options (and their values) before the command are not taken for mistakes: this one
    # gets as far as trying to connect.
    r = gelastic("--timeout", "1", "--connect-timeout=0.5", "--coordinator", "127.0.0.1:1", "jobs")
    assert r.returncode == 2
    assert r.stderr.startswith("gelastic jobs: cannot reach the coordinator at 127.0.0.1:1"), (
        r.stderr
    )
