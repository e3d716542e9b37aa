"""The agent's node secret file: made 0600 on the first start, the same on the next, and never a
reason not to start.

A file planted or damaged in the state dir (a symlink, a FIFO, a directory, someone else's file,
one others may read, garbage, a huge file) is replaced by a new secret with a warning, without
following the link, hanging on the FIFO or reading the huge file whole; a second agent on the
same state dir does not pass for the first. The secret is never logged nor shown in a repr.
"""

from __future__ import annotations

import logging
import os
import re
import stat
from pathlib import Path

import pytest

from client.node_codec import encode_node
from nodeagent._agent_core import hello
from nodeagent._node_secret import NodeSecret, load_node_secret, secret_path
from nodeagent.session import AgentConfig, NodeAgent

NAME = "n1"


@pytest.fixture
def state(tmp_path: Path) -> Path:
    d = tmp_path / "state"
    d.mkdir(mode=0o700)
    return d


def _load(state: Path) -> NodeSecret:
    s = load_node_secret(state, NAME)
    s.close()
    return s


def test_made_0600_on_the_first_start_and_the_same_on_the_next(state: Path) -> None:
    first = _load(state)
    path = secret_path(state, NAME)
    st = os.lstat(path)
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    assert st.st_uid == os.geteuid()
    assert re.fullmatch(r"[0-9a-f]{64}", first.value) and not first.note
    assert path.read_text() == first.value + "\n"
    assert _load(state).value == first.value
    assert [p.name for p in state.iterdir()] == [path.name]  # no temporary file left


def test_a_second_agent_on_the_same_state_dir_does_not_pass_for_the_first(state: Path) -> None:
    first = load_node_secret(state, NAME)
    try:
        second = load_node_secret(state, NAME)
        second.close()
        assert second.value != first.value and second.fd is None
        assert "locked by another agent" in second.note
    finally:
        first.close()
    assert _load(state).value == first.value  # the file was left alone


def _symlink(path: Path) -> str:
    target = path.parent.parent / "elsewhere"
    target.write_text("a" * 64 + "\n")
    target.chmod(0o600)
    path.symlink_to(target)
    return "cannot be read"


def _fifo(path: Path) -> str:
    os.mkfifo(path, 0o600)
    return "not a regular file"


def _garbage(path: Path) -> str:
    path.write_bytes(b"\x00\xffnot a secret")
    path.chmod(0o600)
    return "does not hold a node secret"


def _huge(path: Path) -> str:
    with open(path, "wb") as f:
        f.truncate(64 * 1024 * 1024)  # sparse: nothing is read past the bound
    path.chmod(0o600)
    return "does not hold a node secret"


def _readable(path: Path) -> str:
    path.write_text("b" * 64 + "\n")
    path.chmod(0o644)
    return "readable or writable by others"


def _not_ours(path: Path) -> str:
    if os.geteuid() != 0:
        pytest.skip("needs root to give the file to another user")
    path.write_text("c" * 64 + "\n")
    path.chmod(0o600)
    os.chown(path, 54321, 54321)
    return "owned by uid 54321"


@pytest.mark.parametrize("plant", [_symlink, _fifo, _garbage, _huge, _readable, _not_ours])
def test_a_bad_file_is_replaced_with_a_warning(state: Path, plant: object) -> None:
    path = secret_path(state, NAME)
    why = plant(path)  # type: ignore[operator]
    s = _load(state)
    assert why in s.note and "made a new node secret" in s.note
    st = os.lstat(path)
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    assert st.st_uid == os.geteuid()
    assert path.read_text() == s.value + "\n"
    if plant is _symlink:
        assert (state.parent / "elsewhere").read_text() == "a" * 64 + "\n"  # never followed
    assert _load(state).value == s.value


def test_a_directory_in_the_way_leaves_the_secret_in_memory(state: Path) -> None:
    secret_path(state, NAME).mkdir()
    s = _load(state)
    assert re.fullmatch(r"[0-9a-f]{64}", s.value) and s.fd is None
    assert "cannot keep a node secret" in s.note


async def test_the_agent_starts_whatever_the_file_and_never_logs_the_secret(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    os.mkfifo(secret_path(state, NAME), 0o600)
    config = AgentConfig(
        coordinator="127.0.0.1:1",
        name=NAME,
        addr="127.0.0.1",
        slots=1,
        gpus="none",
        log_dir=str(tmp_path / "logs"),
        state_dir=str(state),
        reconnect_max=0.1,
    )
    caplog.set_level(logging.DEBUG)
    async with NodeAgent(config) as agent:
        secret = agent._node_secret.value
        assert re.fullmatch(r"[0-9a-f]{64}", secret)
        sent = agent._hello()
        assert sent.hello.node_secret == secret
        assert secret not in repr(agent._node_secret)
        msg = hello({}, name=NAME, addr="a", slots=1, incarnation="i", gpus=(), node_secret=secret)
        assert secret not in repr(msg)
        assert encode_node(msg).hello.node_secret == secret
    assert "made a new node secret" in caplog.text
    assert secret not in caplog.text
    # Restarted on the same state dir, it proves the same secret.
    async with NodeAgent(config) as again:
        assert again._node_secret.value == secret
