"""The agent's own directories: where they are by default, and what makes one safe to use.

A directory the agent writes pid files, logs and pickled arguments into must be the agent
user's alone: whoever can create or replace it could plant a pid file for the reaper, swap the
arguments workers unpickle, or read every log. So the defaults are not predictable names in a
shared /tmp but `$XDG_STATE_HOME/gelastic/agent-<node>` (`~/.local/state` when unset) for a user
and `/var/lib/gelastic/agent-<node>` for root, with a fresh `mkdtemp` as the last resort; every
directory the agent creates is 0700; and a directory that exists already is used only if it is
ours and not group/world-writable, in a chain of parents that no one else can rename it in or,
through a symbolic link of theirs, point elsewhere.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Mapping
from pathlib import Path

__all__ = ["UnsafeDirError", "check_dir", "default_agent_dir", "fresh_agent_dir", "private_dir"]


class UnsafeDirError(OSError):
    """A directory the agent was given (or found) that someone else controls."""


def default_agent_dir(name: str, *, uid: int, env: Mapping[str, str], home: str) -> Path:
    """Where agent `name` keeps its state and logs by default (pure; one per node name)."""
    if uid == 0:
        base = Path("/var/lib/gelastic")
    else:
        # The XDG spec says a relative value is invalid and is to be ignored.
        xdg = env.get("XDG_STATE_HOME", "")
        base = Path(xdg if os.path.isabs(xdg) else os.path.join(home, ".local", "state"))
        base = base / "gelastic"
    return base / f"agent-{name}"


def fresh_agent_dir(name: str) -> Path:
    """A new 0700 directory with an unpredictable name (when the default cannot be used)."""
    return Path(tempfile.mkdtemp(prefix=f"gelastic-agent-{name}-"))


def check_dir(path: Path, *, uid: int | None = None) -> None:
    """Raise `UnsafeDirError` unless `path` is a directory that only `uid` (default: us) controls.

    The directory itself must be a real directory (not a symlink) owned by `uid`, writable by
    no one else. Each parent must be owned by `uid` or root, and one that others may write to
    must be sticky (like /tmp): there only an entry's owner can rename or remove it. A parent
    is looked at itself, never through a symbolic link: a link owned by anyone else (who could
    point it elsewhere at any time) is refused, and where the links of `uid` or root lead is
    checked as well, every parent of the real path.
    """
    me = os.geteuid() if uid is None else uid
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeDirError(f"{path} is not a directory")
    if st.st_uid != me:
        raise UnsafeDirError(
            f"refusing {path}: it is owned by uid {st.st_uid}, not by this agent's uid {me}"
        )
    if st.st_mode & 0o022:
        raise UnsafeDirError(
            f"refusing {path}: it is writable by group or others (mode "
            f"{stat.S_IMODE(st.st_mode):04o}); chmod go-w it or use another directory"
        )
    for parent in path.parents:
        pst = os.lstat(parent)
        if stat.S_ISLNK(pst.st_mode):
            if pst.st_uid not in (0, me):
                raise UnsafeDirError(
                    f"refusing {path}: its parent {parent} is a symbolic link owned by uid "
                    f"{pst.st_uid}, who could point it elsewhere"
                )
            continue  # where it leads is checked below
        _check_parent(path, parent, pst, me)
    real = Path(os.path.realpath(path))
    if real != path:
        for parent in real.parents:
            _check_parent(path, parent, os.lstat(parent), me)


def _check_parent(path: Path, parent: Path, pst: os.stat_result, me: int) -> None:
    if pst.st_uid not in (0, me):
        raise UnsafeDirError(
            f"refusing {path}: its parent {parent} is owned by uid {pst.st_uid}, "
            "who could replace it"
        )
    if pst.st_mode & 0o022 and not pst.st_mode & stat.S_ISVTX:
        raise UnsafeDirError(
            f"refusing {path}: its parent {parent} is writable by group or others "
            f"(mode {stat.S_IMODE(pst.st_mode):04o}) and not sticky"
        )


def private_dir(path: Path) -> None:
    """mkdir -p `path`, each level it makes 0700, then `check_dir` it; raises OSError."""
    missing: list[Path] = []
    p = path
    # Bounded by the depth of the path.
    while not os.path.lexists(p):
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        # Made meanwhile: check_dir below judges the result.
        with contextlib.suppress(FileExistsError):
            os.mkdir(d, 0o700)
    check_dir(path)
