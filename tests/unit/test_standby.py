"""Standby workers: the hand-off protocol and a standby taking over a worker of a round.

Real processes (the real bootstrap, no agent): a standby started by `StandbyPool` runs a
script, a ``-m`` module and a function exactly as a cold worker does, with the round's env,
and its output lands in the rank's log files.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from client.assignment import RoundAssignment, WorkerRanks
from client.model import JobSpec, SpecError
from client.results import decode
from nodeagent._bootstrap import parse_handoff
from nodeagent._launch import BOOTSTRAP_PATH, build_standby_launch
from nodeagent._process import spawn
from nodeagent._standby import MAX_HANDOFF_BYTES, StandbyPool, encode_handoff
from nodeagent._workers import WorkerExit, WorkerGroup
from tests._helpers import free_port

ROOT = Path(__file__).resolve().parents[2]
PROBE = ROOT / "tests" / "workloads" / "standby_probe.py"
PRELOAD = ("email.mime.text",)
JOB = "job-7"


def assignment(spec: JobSpec, *, attempt: int = 1, round_: int = 3) -> RoundAssignment:
    n = spec.nproc_per_node
    return RoundAssignment(
        job_id=JOB,
        round=round_,
        attempt=attempt,
        spec=spec,
        group_rank=1,  # no store host on this node
        group_world_size=2,
        master_addr="127.0.0.1",
        master_port=29511,
        workers=tuple(WorkerRanks(i, 2 + i, 2 + i, 2 * n, 2 * n) for i in range(n)),
        run_id="run-abc",
    )


def test_a_standby_imports_what_its_handoff_needs_before_it_waits() -> None:
    # The hand-off is JSON: a standby that imported json only once it came would spend that
    # import on the round's path. Let go unused (EOF), it shows what it imported while waiting.
    rfd, wfd = os.pipe()
    proc = subprocess.Popen(
        [sys.executable, "-X", "importtime", BOOTSTRAP_PATH, "--standby", str(rfd)],
        pass_fds=(rfd,),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    os.close(rfd)
    os.close(wfd)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    imported = {line.rpartition("|")[2].strip() for line in err.splitlines()}
    assert "json" in imported, err


def test_handoff_parsing_refuses_what_is_not_a_handoff() -> None:
    assert parse_handoff(b'{"argv": ["--x"], "env": {"A": "1"}}') == (["--x"], {"A": "1"})
    for bad in (
        b"[]",
        b'{"argv": "x", "env": {}}',
        b'{"argv": [1], "env": {}}',
        b'{"argv": [], "env": {"A=B": "1"}}',
        b'{"argv": [], "env": {"A": 1}}',
        b'{"argv": [], "env": {"A": "\\u0000"}}',
        b'{"argv": []}',
    ):
        with pytest.raises(ValueError):
            parse_handoff(bad)


def test_preload_is_validated() -> None:
    JobSpec(entrypoint=["python", "x.py"], preload=("torch", "torch.distributed")).validate()
    for bad in (("torch; rm",), ("",), (".x",), ("a" * 200,), tuple(f"m{i}" for i in range(33))):
        with pytest.raises(SpecError):
            JobSpec(entrypoint=["python", "x.py"], preload=bad).validate()


def test_a_python_job_without_preload_has_a_bare_standby_and_a_command_none() -> None:
    env: dict[str, str] = {}
    bare = build_standby_launch(JobSpec(entrypoint=["python", "x.py"]), agent_env=env)
    assert bare is not None
    assert bare.preload == ()
    assert bare.argv == bare.prefix  # the bootstrap, no --preload
    assert (
        build_standby_launch(JobSpec(entrypoint=["/bin/true"], preload=PRELOAD), agent_env=env)
        is None
    )


async def _run_round(
    tmp: Path, spec: JobSpec, pool: StandbyPool | None, *, attempt: int = 1
) -> tuple[dict[int, WorkerExit], WorkerGroup]:
    exits: dict[int, WorkerExit] = {}
    done = asyncio.Event()

    def on_exit(ex: WorkerExit) -> None:
        exits[ex.global_rank] = ex
        if len(exits) == spec.nproc_per_node:
            done.set()

    group = WorkerGroup(
        assignment(spec, attempt=attempt),
        node_name="nodeA",
        log_root=tmp / "logs",
        on_exit=on_exit,
        console=None,
        run_dir=tmp,
        spawner=pool.spawner(JOB) if pool is not None else spawn,
        agent_cwd=str(ROOT),
    )
    await group.start()
    await asyncio.wait_for(done.wait(), 60)
    await group.close()
    return exits, group


def _seen(out: Path, rank: int) -> dict[str, Any]:
    return json.loads((out / f"{rank}.json").read_text())


async def _wait_alive(pool: StandbyPool, n: int) -> None:
    # fill() spawned them; they are live processes at once (the import runs in them).
    assert pool.count(JOB) == n


@pytest.mark.parametrize("kind", ["script", "module", "function"])
def test_a_standby_runs_the_round_exactly_as_a_cold_worker(tmp_path: Path, kind: str) -> None:
    entry: Any
    if kind == "script":
        entry = [sys.executable, str(PROBE), "a1", "${local_rank}"]
    elif kind == "module":
        entry = [sys.executable, "-m", "tests.workloads.standby_probe", "a1", "${local_rank}"]
    else:
        entry = "tests.workloads.standby_probe:probe"

    def spec(out: Path, preload: tuple[str, ...]) -> JobSpec:
        return JobSpec(
            entrypoint=entry,
            nproc_per_node=2,
            env={"OUT_DIR": str(out), "JOB_VAR": "v"},
            preload=preload,
            function_args=pickle.dumps((("fn",), {})) if kind == "function" else b"",
        )

    cold_out, warm_out = tmp_path / "cold", tmp_path / "warm"
    cold_out.mkdir()
    warm_out.mkdir()

    async def main() -> None:
        cold_exits, _ = await _run_round(tmp_path / "c", spec(cold_out, ()), None)
        pool = StandbyPool()
        s = spec(warm_out, PRELOAD)
        launch = build_standby_launch(s, agent_env=dict(os.environ), agent_cwd=str(ROOT))
        assert launch is not None
        pool.fill(JOB, launch, 2)
        await pool.warm(JOB)  # forked once the zygote has imported
        standby_pids = set(pool.pids(JOB))
        assert len(standby_pids) == 2
        warm_exits, group = await _run_round(tmp_path / "w", s, pool)
        assert pool.count(JOB) == 0
        assert {e.pid for e in warm_exits.values()} == standby_pids
        for rank in (2, 3):
            assert cold_exits[rank].succeeded, cold_exits[rank].failure
            assert warm_exits[rank].succeeded, warm_exits[rank].failure
            cold, warm = _seen(cold_out, rank), _seen(warm_out, rank)
            assert cold["preloaded"] is False and warm["preloaded"] is True
            for k in ("tag", "name", "main_file", "argv", "path0"):
                assert warm[k] == cold[k], k
            assert warm["fds"] == cold["fds"]  # the hand-off pipe is closed
            assert warm["env"]["TORCHELASTIC_RESTART_COUNT"] == "1"
            assert warm["env"]["RANK"] == str(rank)
            assert warm["env"]["LOCAL_RANK"] == str(rank - 2)
            assert warm["env"]["JOB_VAR"] == "v"
            log = group.plan[rank - 2].stdout_path.read_text()
            assert f"probe rank {rank} out" in log
            assert f"probe rank {rank} err" in group.plan[rank - 2].stderr_path.read_text()
            if kind == "function":
                assert decode(warm_exits[rank].return_value, rank=rank) == rank * 10  # type: ignore[arg-type]
        await pool.close()

    asyncio.run(main())


def test_a_failing_standby_worker_records_its_error_file(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    s = JobSpec(
        entrypoint=[sys.executable, str(PROBE)],
        nproc_per_node=1,
        env={"OUT_DIR": str(out), "PROBE_FAIL": "2"},
        preload=PRELOAD,
    )

    async def main() -> None:
        pool = StandbyPool()
        launch = build_standby_launch(s, agent_env=dict(os.environ), agent_cwd=str(ROOT))
        assert launch is not None
        pool.fill(JOB, launch, 1)
        await pool.warm(JOB)  # forked once the zygote has imported
        exits, group = await _run_round(tmp_path, s, pool)
        failure = exits[2].failure
        assert failure is not None and "probe rank 2 fails" in failure.message
        assert group.plan[0].error_file.exists()
        await pool.close()

    asyncio.run(main())


def test_discarded_standbys_are_gone_and_an_oversized_handoff_starts_cold(tmp_path: Path) -> None:
    s = JobSpec(entrypoint=[sys.executable, str(PROBE)], nproc_per_node=2, preload=PRELOAD)

    async def main() -> None:
        pool = StandbyPool()
        launch = build_standby_launch(s, agent_env=dict(os.environ), agent_cwd=str(ROOT))
        assert launch is not None
        pool.fill(JOB, launch, 2)
        await pool.warm(JOB)  # forked once the zygote has imported
        handles = [st.handle for st in pool._jobs[JOB].idle]
        pool.discard(JOB)
        codes = await asyncio.wait_for(asyncio.gather(*(h.wait() for h in handles)), 10)
        assert all(c in (0, -9) for c in codes)
        assert pool.count(JOB) == 0
        await pool.close()  # and the zygote they were forked from

    asyncio.run(main())
    plan_env = {"X": "y" * (MAX_HANDOFF_BYTES + 1)}

    class _L:
        argv = ("py", "b", "--script", "x")
        env = plan_env

    with pytest.raises(ValueError):
        encode_handoff(_L(), ("py", "b"))  # type: ignore[arg-type]


def test_a_warm_store_host_serves_the_round_it_is_handed(tmp_path: Path) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    from nodeagent._launch import STORE_HOST_PATH, StoreHostLaunch
    from nodeagent._store_host import StoreHost, WarmStoreHost

    port = free_port()
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    launch = StoreHostLaunch(
        argv=(sys.executable, STORE_HOST_PATH),
        env=env,
        cwd=str(tmp_path),
        log_path=tmp_path / "store.log",
        addr="127.0.0.1",
        port=port,
    )

    async def main() -> None:
        cold = {k: v for k, v in env.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
        warm = WarmStoreHost.start(dataclasses.replace(launch, env=cold, port=1))
        host = StoreHost.start(launch, ctx="[t]", warm=warm)
        assert host.pid == warm.process.pid
        watch = asyncio.ensure_future(host.watch())

        def use() -> bytes:
            client = dist.TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=30))
            client.set("k", "v")
            return bytes(client.get("k"))

        assert await asyncio.to_thread(use) == b"v"
        # The store answered; its "ready" line may still be on its way to the loop.
        for _ in range(500):
            if host.state == "ready":
                break
            await asyncio.sleep(0.01)
        assert host.state == "ready"
        assert await host.stop(2.0)
        await watch
        host.close()

    asyncio.run(main())


def test_preload_travels_on_the_wire_and_from_the_cli(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gelastic._cli_run import plan_run, run_parser

    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.py").write_text("")  # `gelastic run` checks the script is there
    from client.wire import spec_from_pb, spec_to_pb

    spec = JobSpec(entrypoint=["python", "x.py"], preload=("torch", "numpy"))
    assert spec_from_pb(spec_to_pb(spec)).preload == ("torch", "numpy")
    assert spec_from_pb(spec_to_pb(JobSpec(entrypoint=["python", "x.py"]))).preload == ()
    args = run_parser().parse_args(["--preload", "torch", "--nproc-per-node", "2", "x.py"])
    assert plan_run(args).spec.preload == ("torch",)


def test_a_succeeded_jobs_standbys_linger_only_for_an_equal_spec_and_only_so_long() -> None:
    s = JobSpec(
        entrypoint=[sys.executable, str(PROBE)],
        nproc_per_node=2,
        preload=PRELOAD,
        standby_linger=30.0,
    )
    other = dataclasses.replace(s, env={"SWEEP_ARM": "b"})

    def launch_of(spec: JobSpec) -> Any:
        launch = build_standby_launch(spec, agent_env=dict(os.environ), agent_cwd=str(ROOT))
        assert launch is not None
        return launch

    async def main() -> None:
        pool = StandbyPool()
        pool.fill(JOB, launch_of(s), 2)
        await pool.warm(JOB)  # forked once the zygote has imported
        first = sorted(pool.pids(JOB))
        pool.release(JOB, 30.0)
        assert pool.count(JOB) == 0 and pool.lingering() == 2
        # Another spec (one env variable differs) finds nothing to adopt.
        assert not pool.adopt("job-8", launch_of(other))
        assert pool.lingering() == 2
        # The same spec takes them over, processes and all.
        assert pool.adopt("job-9", launch_of(s))
        assert sorted(pool.pids("job-9")) == first and pool.lingering() == 0
        # Released with no linger: killed, as a job without standby_linger does.
        handles = [st.handle for st in pool._jobs["job-9"].idle]
        pool.release("job-9", 0.0)
        assert pool.lingering() == 0 and pool.count("job-9") == 0
        codes = await asyncio.wait_for(asyncio.gather(*(h.wait() for h in handles)), 10)
        assert all(c in (0, -9) for c in codes)
        # A linger runs out: killed then, without a job to take them.
        pool.fill("job-10", launch_of(s), 1)
        await pool.warm("job-10")  # forked once the zygote has imported
        (handle,) = [st.handle for st in pool._jobs["job-10"].idle]
        pool.release("job-10", 0.2)
        assert pool.lingering() == 1
        assert await asyncio.wait_for(handle.wait(), 10) in (0, -9)
        assert pool.lingering() == 0
        await pool.close()

    asyncio.run(main())


def test_standby_linger_is_validated_and_travels_on_the_wire() -> None:
    from client.wire import spec_from_pb, spec_to_pb

    spec = JobSpec(entrypoint=["python", "x.py"], preload=("torch",), standby_linger=12.5)
    assert spec_from_pb(spec_to_pb(spec)).standby_linger == 12.5
    with pytest.raises(SpecError, match="standby_linger"):
        JobSpec(entrypoint=["python", "x.py"], standby_linger=5.0).validate()  # no standbys
    with pytest.raises(SpecError, match="standby_linger"):
        JobSpec(entrypoint=["python", "x.py"], preload=("torch",), standby_linger=1e9).validate()


def test_a_warm_store_host_key_ignores_what_its_hand_off_brings() -> None:
    # A later job of the same spec (a sweep) must find the warm store host the last one left:
    # its job id, run id and round come with the hand-off; anything else must be equal.
    from nodeagent._launch import STORE_HOST_PATH, StoreHostLaunch
    from nodeagent._store_host import warm_key

    def launch(**env: str) -> StoreHostLaunch:
        return StoreHostLaunch(
            argv=(sys.executable, STORE_HOST_PATH),
            env={"PATH": "/usr/bin", **env},
            cwd="/",
            log_path=Path("/nonexistent/store.log"),
            addr="127.0.0.1",
            port=1,
        )

    a = launch(GELASTIC_JOB_ID="job-a", TORCHELASTIC_RUN_ID="job-a", GELASTIC_ROUND="1")
    b = launch(GELASTIC_JOB_ID="job-b", TORCHELASTIC_RUN_ID="job-b", GELASTIC_ROUND="4")
    assert warm_key(a) == warm_key(b)
    assert warm_key(a) != warm_key(launch(GELASTIC_JOB_ID="job-b", SWEEP_ARM="2"))


def test_close_waits_for_standbys_that_were_killed_before_it() -> None:
    # A job's standbys are killed when it ends; an agent that stops right after must still wait
    # until they are gone, or its sentinel finds them tearing down and reports them left behind.
    s = JobSpec(entrypoint=[sys.executable, str(PROBE)], nproc_per_node=2, preload=PRELOAD)

    async def main() -> None:
        pool = StandbyPool()
        launch = build_standby_launch(s, agent_env=dict(os.environ), agent_cwd=str(ROOT))
        assert launch is not None
        pool.fill(JOB, launch, 2)
        await pool.warm(JOB)  # forked once the zygote has imported
        handles = [st.handle for st in pool._jobs[JOB].idle]
        pool.discard(JOB)
        await pool.close()
        assert not any(h.is_alive() for h in handles)

    asyncio.run(main())


def test_a_preload_that_fails_in_the_zygote_leaves_the_first_round_cold(tmp_path: Path) -> None:
    # As a standby of its own did: the failure is on the stderr of the standby that takes over
    # a rank; the first round does not wait on a zygote that could not import what it was asked.
    out = tmp_path / "out"
    out.mkdir()
    s = JobSpec(
        entrypoint=[sys.executable, str(PROBE)],
        nproc_per_node=1,
        env={"OUT_DIR": str(out)},
        preload=("no_such_module_for_gelastic_tests",),
    )
    said = "gelastic standby: cannot preload no_such_module_for_gelastic_tests"

    async def main() -> None:
        pool = StandbyPool()
        launch = build_standby_launch(s, agent_env=dict(os.environ), agent_cwd=str(ROOT))
        assert launch is not None
        assert not await pool.prepare(JOB, launch)
        exits, group = await _run_round(tmp_path / "r1", s, pool)
        assert exits[2].succeeded, exits[2].failure
        assert said not in group.plan[0].stderr_path.read_text()  # cold: nothing preloaded
        pool.fill(JOB, launch, 1)
        assert await pool.warm(JOB) == 1
        (standby,) = pool.pids(JOB)
        exits, group = await _run_round(tmp_path / "r2", s, pool)
        assert exits[2].pid == standby and exits[2].succeeded, exits[2].failure
        assert said in group.plan[0].stderr_path.read_text()
        await pool.close()

    asyncio.run(main())


def test_a_zygote_whose_import_hangs_holds_one_round_start_and_not_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import nodeagent._standby as standby

    monkeypatch.setattr(standby, "READY_WAIT_S", 1.0)
    s = JobSpec(
        entrypoint=[sys.executable, str(PROBE)],
        nproc_per_node=1,
        env={"PYTHONPATH": str(ROOT), "HANG_UNTIL": str(tmp_path / "never")},
        preload=("tests.workloads.preload_hangs",),
    )

    async def main() -> None:
        pool = StandbyPool()
        launch = build_standby_launch(s, agent_env=dict(os.environ), agent_cwd=str(ROOT))
        assert launch is not None
        assert not await asyncio.wait_for(pool.prepare(JOB, launch), 30)  # waited 1 s: cold
        zygote = pool._jobs[JOB].zygote
        assert zygote is not None and zygote.alive() and not zygote.is_ready()
        # The same zygote, still importing: the next round does not wait for it again.
        assert not await asyncio.wait_for(pool.prepare(JOB, launch), 0.5)
        await pool.close()

    asyncio.run(main())
