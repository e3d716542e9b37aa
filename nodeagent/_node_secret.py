"""The node secret: how a restarted agent proves to the coordinator that it is the same node.

A random secret kept in `agent-<name>.secret` in the agent's state dir (0600, in a directory the
agent owns), made on the first start and sent with every hello. A restarted agent reads it back,
so the coordinator hands it its node's name at once instead of keeping the name for the dead
process until its reconnect grace ends.

The file is locked (flock) for the life of the agent, so two agents started on one state dir do
not both pass for the node: the second one runs without the proof (and the coordinator refuses it
the name while the first one lives). A file that is not ours, not 0600, not a regular file or not
a secret is never a reason not to start: the agent says so and makes a new one (the coordinator
then keeps the name for the previous agent during its grace, as for any new agent). The secret
itself is never logged.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import stat
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["NodeSecret", "load_node_secret", "secret_path"]

logger = logging.getLogger(__name__)

SECRET_BYTES = 32
MAX_FILE_BYTES = 256
"""A secret file longer than this is not one of ours: it is read no further."""
_SECRET = re.compile(r"[0-9a-f]{64}\n?")


@dataclass
class NodeSecret:
    """The agent's node secret and the open, locked file that holds it (None: not kept)."""

    value: str = field(repr=False)
    fd: int | None = None
    note: str = ""
    """Why the secret is not the one kept on disk from a previous start ("" = it is, or it is
    new and kept): said once at start."""

    def close(self) -> None:
        """Release the lock (the file stays for the next start); idempotent."""
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = None


def secret_path(state_dir: Path, name: str) -> Path:
    return state_dir / f"agent-{name}.secret"


def load_node_secret(state_dir: Path, name: str) -> NodeSecret:
    """The node secret kept in `state_dir` for agent `name`, made when there is none (or a bad
    one). Never raises for a file: what cannot be kept is said in `note` and the secret lives
    in memory only."""
    path = secret_path(state_dir, name)
    held: list[int] = []  # a bad file's lock, kept until it is replaced
    try:
        return _load(path, held)
    finally:
        for fd in held:
            os.close(fd)


def _load(path: Path, held: list[int]) -> NodeSecret:
    found = _read(path, held)
    if isinstance(found, NodeSecret):
        return found
    if found == _BUSY:
        return NodeSecret(
            _new_value(),
            note=f"{path} is locked by another agent (is this one started twice on one state "
            "dir?); this agent cannot prove it is that node, and the coordinator will not hand "
            "it the node's name while that agent lives",
        )
    bad = "" if found == _MISSING else found
    try:
        made = _write(path, replace=bool(bad))
    except OSError as exc:
        why = f"{bad}; " if bad else ""
        return NodeSecret(
            _new_value(),
            note=f"cannot keep a node secret in {path} ({why}{exc.strerror or exc}); a restart "
            "of this agent will not prove it is this node",
        )
    if made is None:
        # Another agent made it meanwhile: it holds it now, or this one does.
        again = _read(path, held)
        if isinstance(again, NodeSecret):
            return again
        return NodeSecret(_new_value(), note=f"{path} was made by another agent meanwhile")
    if bad:
        made.note = (
            f"{path} {bad}; made a new node secret (the coordinator may keep this node's name "
            "for its previous agent until its reconnect grace ends)"
        )
    return made


_MISSING = "missing"
_BUSY = "busy"


def _new_value() -> str:
    # As secrets.token_hex, without importing secrets (hmac, and with it libcrypto).
    return os.urandom(SECRET_BYTES).hex()


def _read(path: Path, held: list[int]) -> NodeSecret | str:
    """The kept secret (its file open and locked), _MISSING, _BUSY, or what is wrong with it.

    A bad file this agent could lock stays locked (its descriptor added to `held`) while it is
    replaced: another agent on the same state dir meanwhile finds it, or the new one, busy."""
    try:
        # O_NONBLOCK: a FIFO planted there must not hang the open; O_NOFOLLOW: nor a symlink
        # lead elsewhere.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return _MISSING
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    keep = False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return "is not a regular file"
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return _BUSY
        held.append(fd)
        keep = True
        if st.st_uid != os.geteuid():
            return f"is owned by uid {st.st_uid}, not by this agent's"
        if stat.S_IMODE(st.st_mode) & 0o077:
            return f"is readable or writable by others (mode {stat.S_IMODE(st.st_mode):04o})"
        data = os.read(fd, MAX_FILE_BYTES + 1)
        text = data.decode("ascii", errors="replace")
        if len(data) > MAX_FILE_BYTES or not _SECRET.fullmatch(text):
            return "does not hold a node secret"
        held.remove(fd)
        return NodeSecret(text.strip(), fd)
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    finally:
        if not keep:
            os.close(fd)


def _write(path: Path, *, replace: bool) -> NodeSecret | None:
    """A new secret in a new file at `path`, locked; None when another agent made one there
    first (not with `replace`). The file appears whole or not at all."""
    value = _new_value()
    # mkstemp: O_EXCL, O_NOFOLLOW and 0600, in the agent's own directory.
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.set_inheritable(fd, False)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, (value + "\n").encode("ascii"))
        os.fsync(fd)
        if replace:
            os.replace(tmp, path)  # the name itself, never where a symlink there points
        else:
            try:
                os.link(tmp, path)
            except FileExistsError:
                os.close(fd)
                return None
        return NodeSecret(value, fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.close(fd)
        raise
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
