"""The sentinel's scan and choice of victims, on a fake /proc: no process is signalled here."""

from __future__ import annotations

from pathlib import Path

import pytest

from nodeagent._sentinel import (
    MARK_ENV,
    ProcInfo,
    Targets,
    Watch,
    read_stat,
    scan,
    select_victims,
    sweep,
)

TOKEN = "a" * 32


def _stat(pid: int, comm: str, state: str, sid: int, ticks: int) -> str:
    # Fields as the kernel writes them: pid (comm) state ppid pgrp session ... starttime (22nd).
    rest = [state, "1", str(pid), str(sid)] + ["0"] * 15 + [str(ticks)] + ["0"] * 30
    return f"{pid} ({comm}) {' '.join(rest)}\n"


def _fake_proc(
    root: Path, procs: list[tuple[int, str, str, int, int, dict[str, str] | None]]
) -> str:
    """A /proc with (pid, comm, state, sid, start ticks, env or None = unreadable) entries."""
    for pid, comm, state, sid, ticks, env in procs:
        d = root / str(pid)
        d.mkdir()
        (d / "stat").write_text(_stat(pid, comm, state, sid, ticks))
        if env is not None:
            (d / "environ").write_bytes(b"".join(f"{k}={v}\0".encode() for k, v in env.items()))
    (root / "self").mkdir()  # not a pid: skipped
    (root / "meminfo").write_text("")
    return str(root)


def _p(pid: int, sid: int, ticks: int = 100, mark: str | None = None) -> ProcInfo:
    return ProcInfo(pid, sid, ticks, "S", mark)


def test_read_stat_survives_a_command_name_with_spaces_and_parentheses(tmp_path: Path) -> None:
    proc = _fake_proc(tmp_path, [(42, "a) (b c) ", "S", 40, 12345, {})])
    assert read_stat(42, proc) == (40, 12345, "S")
    assert read_stat(43, proc) is None


def test_scan_reads_session_start_and_mark_and_skips_zombies(tmp_path: Path) -> None:
    proc = _fake_proc(
        tmp_path,
        [
            (10, "worker", "S", 10, 500, {"PATH": "/bin", MARK_ENV: f"{TOKEN}.1"}),
            (11, "child", "R", 10, 501, {"PATH": "/bin"}),
            (12, "zombie", "Z", 10, 502, {MARK_ENV: f"{TOKEN}.1"}),
            (13, "other-user", "S", 13, 503, None),
        ],
    )
    found = {p.pid: p for p in scan(proc)}
    assert set(found) == {10, 11, 13}
    assert found[10] == ProcInfo(10, 10, 500, "S", f"{TOKEN}.1")
    assert found[11].mark is None and found[11].sid == 10
    assert found[13].mark is None  # environ unreadable: no mark, still matched by session


def test_members_of_a_session_are_victims_whether_or_not_they_carry_the_mark() -> None:
    procs = [_p(10, 10, 100), _p(11, 10, 101), _p(12, 12, 102), _p(20, 20, 50)]
    victims = select_victims(procs, Targets({10: 100}))
    assert [p.pid for p in victims] == [10, 11]


def test_marked_processes_are_victims_in_any_session() -> None:
    procs = [
        _p(11, 11, mark=f"{TOKEN}.1"),  # setsid, env kept
        _p(12, 12, mark=f"{TOKEN}.2"),  # another worker's: not in this sweep
        _p(13, 13, mark="b" * 32 + ".1"),  # another agent's
        _p(14, 14),
    ]
    assert [p.pid for p in select_victims(procs, Targets({}, marks=[f"{TOKEN}.1"]))] == [11]
    everything = Targets({}, mark_prefix=f"{TOKEN}.")
    assert [p.pid for p in select_victims(procs, everything)] == [11, 12]


def test_a_stranger_that_got_the_session_leaders_pid_voids_the_session() -> None:
    # Pid 10 is alive but started later than the worker that was 10: the worker's session is
    # over and 10 is someone else's; members of a session 10 are that stranger's, not ours.
    procs = [_p(10, 10, ticks=900), _p(11, 10, ticks=901)]
    assert select_victims(procs, Targets({10: 100})) == []
    # The leader itself still there (alive or a zombie not scanned): its session is ours.
    assert [p.pid for p in select_victims([_p(11, 10, 150)], Targets({10: 100}))] == [11]


def test_processes_older_than_the_session_leader_are_never_victims() -> None:
    assert select_victims([_p(11, 10, ticks=99)], Targets({10: 100})) == []


def test_watch_turns_the_agents_lines_into_sweeps() -> None:
    w = Watch(TOKEN)
    assert w.feed(f"+ 10 100 {TOKEN}.1") is None
    assert w.feed(f"+ 20 200 {TOKEN}.2") is None
    assert w.feed("garbage") is None
    assert w.feed("- 99") is None  # never started: nothing to sweep
    exited = w.feed("- 10")
    assert exited == Targets({10: 100}, marks=(f"{TOKEN}.1",))
    assert w.feed("- 10") is None  # already swept
    final = w.final()
    assert dict(final.sessions) == {20: 200}
    assert list(final.marks) == [f"{TOKEN}.2"]
    assert final.mark_prefix == f"{TOKEN}."


def test_sweep_rescans_until_nothing_is_left(tmp_path: Path) -> None:
    # Killing 11 "forks" 12 (a process that forks while being killed): the next scan finds it.
    root = Path(_fake_proc(tmp_path, [(10, "w", "S", 10, 100, {}), (11, "c", "S", 10, 101, {})]))
    killed: list[int] = []

    def killer(p: ProcInfo) -> bool:
        killed.append(p.pid)
        (root / str(p.pid) / "stat").write_text(_stat(p.pid, "x", "Z", p.sid, p.start_ticks))
        if p.pid == 11:
            (root / "12").mkdir()
            (root / "12" / "stat").write_text(_stat(12, "gc", "S", 10, 102))
        return True

    assert sorted(sweep(Targets({10: 100}), proc=str(root), killer=killer)) == [10, 11, 12]
    assert killed[-1] == 12  # found by the rescan, after 11 was killed


def test_sweep_gives_up_after_its_budget_on_a_process_that_will_not_die(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    proc = _fake_proc(tmp_path, [(11, "dstate", "D", 10, 101, {})])
    now = [0.0]

    def clock() -> float:
        now[0] += 1.0
        return now[0]

    attempts: list[int] = []
    signalled = sweep(
        Targets({10: 100}),
        proc=proc,
        budget=3.0,
        killer=lambda p: attempts.append(p.pid) is None,
        clock=clock,
    )
    assert signalled == [11]
    assert 1 < len(attempts) <= 4
    assert "still alive after SIGKILL: [11]" in capsys.readouterr().err
