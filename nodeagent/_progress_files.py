"""The agent's end of progress reporting: each worker's progress file, read and forwarded.

A worker's `client.progress` writes its latest step to `progress.json` in its log directory
(the agent's, 0700), named in its `GELASTIC_PROGRESS_FILE`. `ProgressFiles` stats each of a
round's files (`poll`), reads one only when it changed (at most `MAX_PROGRESS_BYTES`, never
trusted: `client.progress.parse_progress`), and says which ranks' progress changed since the
last poll. `ProgressForwarder` runs that every `FORWARD_EVERY_S` for every held round and sends
one `ProgressReport` per round with changes: at most a few messages per second per node however
often the workers step.
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from client.node_protocol import NodeMsg, ProgressReport, RankProgress
from client.progress import (
    MAX_PROGRESS_BYTES,
    ProgressSample,
    parse_progress,
)
from nodeagent._launch import progress_file

__all__ = ["FORWARD_EVERY_S", "ProgressFiles", "ProgressForwarder", "held_progress_files"]

logger = logging.getLogger(__name__)

FORWARD_EVERY_S = 0.5
"""How often the agent reads its workers' progress and sends what changed."""


class ProgressFiles:
    """The progress files of one round's workers on this node."""

    def __init__(self, job_id: str, round_: int, workers: Iterable[tuple[int, int, Path]]) -> None:
        """`workers`: (local rank, global rank, progress file) of each worker."""
        self.job_id, self.round = job_id, round_
        self._files = {lr: (gr, Path(p)) for lr, gr, p in workers}
        self._seen: dict[int, tuple[int, int, int]] = {}
        self._latest: dict[int, RankProgress] = {}
        self._sent: dict[int, RankProgress] = {}

    def poll(self) -> ProgressReport | None:
        """The ranks whose progress changed since the last poll (None: none did). Blocking
        (a stat per worker): run it off the event loop."""
        changed = []
        for lr, (gr, path) in self._files.items():
            sample = self._read(lr, path)
            if sample is not None:
                self._latest[lr] = RankProgress(
                    lr, gr, sample.step, sample.steps_per_s, sample.metrics
                )
            latest = self._latest.get(lr)
            if latest is not None and self._sent.get(lr) != latest:
                self._sent[lr] = latest
                changed.append(latest)
        return ProgressReport(self.job_id, self.round, tuple(changed)) if changed else None

    def resend(self) -> None:
        """A new session: the next poll sends every rank's latest progress again."""
        self._sent.clear()

    def _read(self, lr: int, path: Path) -> ProgressSample | None:
        try:
            st = os.stat(path)
        except OSError:
            return None
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        if self._seen.get(lr) == key or st.st_size > MAX_PROGRESS_BYTES:
            return None
        if not stat.S_ISREG(st.st_mode):
            return None  # a FIFO, a device, a directory: never a progress file
        self._seen[lr] = key
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            return None
        try:
            if not os.path.samestat(os.fstat(fd), st):
                return None  # replaced between the stat and the open: the next poll reads it
            data = os.read(fd, MAX_PROGRESS_BYTES + 1)
        except OSError:
            return None
        finally:
            os.close(fd)
        return parse_progress(data)


def held_progress_files(
    held: Mapping[tuple[str, int], Any], known: dict[tuple[str, int], ProgressFiles]
) -> list[ProgressFiles]:
    """The progress files of each held round whose workers run (their launch plan is made),
    kept in `known` (by job id and round) from one call to the next."""
    live = {key for key, h in held.items() if h.group is not None and not h.stopped}
    for key in [k for k in known if k not in live]:
        del known[key]
    for key in live:
        plan = getattr(held[key].group, "plan", None)
        if key not in known and plan:
            known[key] = ProgressFiles(
                key[0],
                key[1],
                ((w.local_rank, w.global_rank, progress_file(w.log_dir)) for w in plan),
            )
    return list(known.values())


class ProgressForwarder:
    """Polls the progress files of every held round and sends what changed."""

    def __init__(
        self,
        rounds: Callable[[], Iterable[ProgressFiles]],
        send: Callable[[NodeMsg], None],
        every: float = FORWARD_EVERY_S,
    ) -> None:
        self._rounds = rounds
        self._send = send
        self.every = every

    @classmethod
    def of_held(
        cls,
        held: Callable[[], Mapping[tuple[str, int], Any] | None],
        send: Callable[[NodeMsg], None],
    ) -> tuple[ProgressForwarder, dict[tuple[str, int], ProgressFiles]]:
        """A forwarder of the rounds `held()` gives (None while no session is up, when nothing
        is sent), and the files it keeps by round (each `resend()` when a session opens)."""
        known: dict[tuple[str, int], ProgressFiles] = {}

        def rounds() -> list[ProgressFiles]:
            now_held = held()
            return [] if now_held is None else held_progress_files(now_held, known)

        return cls(rounds, send), known

    @staticmethod
    def poll_all(rounds: Iterable[ProgressFiles]) -> list[ProgressReport]:
        return [r for files in rounds if (r := files.poll()) is not None]

    async def run(self) -> None:
        while True:  # owned by the agent session, cancelled when it stops
            await asyncio.sleep(self.every)
            rounds = list(self._rounds())  # on the loop: the held rounds change there
            if rounds:
                for report in await asyncio.to_thread(self.poll_all, rounds):
                    self._send(report)
