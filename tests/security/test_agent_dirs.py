"""The agent's directories are its own: not a predictable name in /tmp, refused when others control them.

Before the fix the default log root (and pid file dir) was /tmp/gelastic-<uid>/logs, made with
mkdir(exist_ok=True) whoever owned it: a local user who made it first could plant a pid file
for the reaper, swap the arguments workers unpickle, or read every log. A dir given with
--log-dir was used whatever its owner and mode, and the pid file was written through a fixed
temp name that a planted symlink redirected onto any file the agent could write.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest

from nodeagent import session as session_module
from nodeagent._dirs import UnsafeDirError, check_dir, default_agent_dir
from nodeagent._reaper import PidRegistry
from nodeagent.session import AgentConfig, NodeAgent


def _config(**kw: str) -> AgentConfig:
    return AgentConfig(coordinator="127.0.0.1:1", name="n1", addr="127.0.0.1", **kw)


def test_the_default_dir_is_the_users_own_per_node_and_not_in_tmp() -> None:
    agent = NodeAgent(AgentConfig(coordinator="127.0.0.1:1", name="node-a", addr="127.0.0.1"))
    tmp = Path(tempfile.gettempdir()).resolve()
    assert not agent.log_root.is_relative_to(tmp), agent.log_root
    assert "agent-node-a" in agent.log_root.parts
    other = NodeAgent(AgentConfig(coordinator="127.0.0.1:1", name="node-b", addr="127.0.0.1"))
    assert other.log_root != agent.log_root

    env = {"XDG_STATE_HOME": "/srv/state"}
    assert default_agent_dir("n", uid=1000, env=env, home="/home/u") == Path(
        "/srv/state/gelastic/agent-n"
    )
    # Unset or relative (invalid per the XDG spec): ~/.local/state.
    for env in ({}, {"XDG_STATE_HOME": "rel/state"}):
        assert default_agent_dir("n", uid=1000, env=env, home="/home/u") == Path(
            "/home/u/.local/state/gelastic/agent-n"
        )
    assert default_agent_dir("n", uid=0, env={}, home="/root") == Path("/var/lib/gelastic/agent-n")


async def test_dirs_the_agent_makes_are_0700(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        agent = NodeAgent(
            _config(log_dir=str(tmp_path / "a" / "logs"), state_dir=str(tmp_path / "s"))
        )
        await agent.start()
        await agent.stop(0)
    finally:
        os.umask(old)
    for d in (tmp_path / "a", tmp_path / "a" / "logs", tmp_path / "s"):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d


@pytest.mark.parametrize("which", ["log_dir", "state_dir"])
async def test_a_world_writable_dir_is_refused_at_start(tmp_path: Path, which: str) -> None:
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    dirs = {"log_dir": str(tmp_path / "logs"), "state_dir": str(tmp_path / "state")}
    dirs[which] = str(open_dir)
    agent = NodeAgent(_config(**dirs))
    with pytest.raises(UnsafeDirError, match="writable by group or others"):
        await agent.start()
    await agent.stop(0)
    assert list(open_dir.iterdir()) == []  # no pid file, no log written into it


async def test_a_dir_in_a_parent_others_may_write_is_refused(tmp_path: Path) -> None:
    open_parent = tmp_path / "open"
    open_parent.mkdir()
    open_parent.chmod(0o777)  # not sticky: anyone could rename our logs dir away and replace it
    agent = NodeAgent(_config(log_dir=str(open_parent / "logs")))
    with pytest.raises(UnsafeDirError, match="parent"):
        await agent.start()
    await agent.stop(0)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a dir away needs root")
async def test_a_dir_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 65534, 65534)
    agent = NodeAgent(_config(log_dir=str(theirs)))
    with pytest.raises(UnsafeDirError, match="owned by uid 65534"):
        await agent.start()
    await agent.stop(0)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a link away needs root")
async def test_a_parent_that_is_another_users_symbolic_link_is_refused(tmp_path: Path) -> None:
    # Before, the parents were stat()ed through links: a link another user owns (and can point
    # anywhere at any time) passed as whatever it pointed at when the agent looked.
    real = tmp_path / "real"
    (real / "logs").mkdir(parents=True, mode=0o700)
    real.chmod(0o755)
    link = tmp_path / "link"
    link.symlink_to(real)
    os.lchown(link, 65534, 65534)
    agent = NodeAgent(_config(log_dir=str(link / "logs")))
    with pytest.raises(UnsafeDirError, match="symbolic link owned by uid 65534"):
        await agent.start()
    await agent.stop(0)
    # The same link, ours: where it leads is checked, and here that is fine.
    os.lchown(link, os.geteuid(), os.getegid())
    check_dir(link / "logs")
    # A link of ours into a directory another user owns is refused all the same.
    theirs = tmp_path / "theirs"
    (theirs / "logs").mkdir(parents=True, mode=0o700)
    os.chown(theirs, 65534, 65534)
    ours = tmp_path / "ours"
    ours.symlink_to(theirs)
    with pytest.raises(UnsafeDirError, match=f"parent {theirs} is owned by uid 65534"):
        check_dir(ours / "logs")


def test_a_symlink_at_the_pid_files_temp_name_does_not_redirect_the_write(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    victim = tmp_path / "precious"
    victim.write_text("keep me\n")
    pid_file = state / "agent-n1.pids.json"
    (state / "agent-n1.pids.json.tmp").symlink_to(victim)
    child = subprocess.Popen(["sleep", "60"])
    try:
        registry = PidRegistry(pid_file, mark_prefix="e" * 32 + ".")
        registry.add(child.pid, job_id="j", global_rank=0)
    finally:
        child.kill()
        child.wait()
    assert victim.read_text() == "keep me\n"
    st = pid_file.lstat()
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    assert str(child.pid) in pid_file.read_text()


async def test_an_unusable_default_falls_back_to_a_fresh_private_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Say the default's parent is one that others may write to: it is not used, nor refused.
    open_parent = tmp_path / "open"
    open_parent.mkdir()
    open_parent.chmod(0o777)
    monkeypatch.setattr(session_module, "_default_log_dir", lambda name: str(open_parent / "logs"))
    agent = NodeAgent(_config())
    await agent.start()
    try:
        assert not agent.log_root.is_relative_to(open_parent)
        assert agent.log_root.name.startswith("gelastic-agent-n1-")
        assert stat.S_IMODE(agent.log_root.stat().st_mode) == 0o700
        assert agent._registry.path.parent == agent.state_dir == agent.log_root
    finally:
        await agent.stop(0)
        shutil.rmtree(agent.log_root)
