"""ErrorFileWatch: real files in a temporary directory, bounded waits."""

from __future__ import annotations

import asyncio
import json
import os
import struct
from pathlib import Path

import pytest

from nodeagent._inotify import ErrorFileWatch

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/sys/fs/inotify"), reason="no inotify")


async def _watch(tmp_path: Path, names: list[str]) -> tuple[ErrorFileWatch, asyncio.Queue[Path]]:
    seen: asyncio.Queue[Path] = asyncio.Queue()
    w = ErrorFileWatch(seen.put_nowait)
    assert w.start()
    for n in names:
        (tmp_path / n).mkdir(exist_ok=True)
        assert w.watch(tmp_path / n / "error.json")
    return w, seen


async def test_a_write_in_one_open_is_announced_once_closed(tmp_path: Path) -> None:
    w, seen = await _watch(tmp_path, ["0"])
    try:
        path = tmp_path / "0" / "error.json"
        with open(path, "w") as f:  # as torch's @record writes it
            json.dump({"message": "x"}, f)
            f.flush()
            await asyncio.sleep(0)  # the loop runs while the file is open: nothing yet
            assert seen.empty()
        got = await asyncio.wait_for(seen.get(), 5.0)
        assert got == path
    finally:
        w.close()


async def test_a_rename_into_place_is_announced_and_other_names_are_not(tmp_path: Path) -> None:
    w, seen = await _watch(tmp_path, ["0", "1"])
    try:
        (tmp_path / "0" / "stderr.log").write_text("noise")  # not the error file
        tmp = tmp_path / "1" / ".error.json.tmp"
        tmp.write_text("{}")
        os.replace(tmp, tmp_path / "1" / "error.json")
        got = await asyncio.wait_for(seen.get(), 5.0)
        assert got == tmp_path / "1" / "error.json"
        assert seen.empty()
    finally:
        w.close()


async def test_watches_are_bounded_and_close_is_idempotent(tmp_path: Path) -> None:
    seen: list[Path] = []
    w = ErrorFileWatch(seen.append, max_watches=1)
    assert w.start()
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    assert w.watch(tmp_path / "a" / "error.json")
    assert not w.watch(tmp_path / "b" / "error.json")  # over the bound
    w.close()
    w = ErrorFileWatch(seen.append)
    assert w.start()
    assert not w.watch(tmp_path / "missing" / "error.json")  # no such directory
    w.close()
    w.close()
    assert not w.active
    assert not w.watch(tmp_path / "a" / "error.json")


def test_a_malformed_event_buffer_is_dropped_not_raised(tmp_path: Path) -> None:
    seen: list[Path] = []
    w = ErrorFileWatch(seen.append)
    w._by_wd[1] = (tmp_path, {b"error.json"})

    # A name length past the buffer: the rest of the read is dropped.
    w._parse(struct.pack("iIII", 1, 0x8, 0, 4096) + b"error.json")
    assert seen == []
    w._parse(struct.pack("iIII", 1, 0x8, 0, 16) + b"error.json".ljust(16, b"\0"))
    assert seen == [tmp_path / "error.json"]


def test_a_queue_overflow_announces_every_watched_file(tmp_path: Path) -> None:
    seen: list[Path] = []
    w = ErrorFileWatch(seen.append)
    w._by_wd[1] = (tmp_path / "0", {b"error.json"})
    w._by_wd[2] = (tmp_path / "1", {b"error.json"})
    w._parse(struct.pack("iIII", -1, 0x4000, 0, 0))  # IN_Q_OVERFLOW: events were lost
    assert sorted(seen) == [tmp_path / "0" / "error.json", tmp_path / "1" / "error.json"]


async def test_aclose_closes_the_descriptor_off_the_loop_and_is_idempotent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    from nodeagent import _inotify

    w, _ = await _watch(tmp_path, ["0"])
    fd = w._fd
    assert fd is not None
    closed_in: list[int] = []
    real_close = os.close

    def close(n: int) -> None:
        if n == fd:
            closed_in.append(threading.get_ident())
        real_close(n)

    monkeypatch.setattr(_inotify.os, "close", close)
    await w.aclose()
    await w.aclose()
    w.close()
    assert len(closed_in) == 1 and closed_in[0] != threading.get_ident()
    with pytest.raises(OSError):
        os.fstat(fd)  # closed (nothing else opened a file meanwhile in this test)
