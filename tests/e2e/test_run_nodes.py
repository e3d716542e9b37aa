"""`gelastic run` on every node: several real launchers on this host form one job.

Each launcher is a `gelastic run` process in a session of its own, with its own temp dir (so
its own log and state dirs), as torch's own test_launch_elastic_multiple_agents runs several
agents on one host. Workers are real torch/gloo DDP ranks (tests/workloads/ddp_nodes.py).
Every test checks, by a marker in the environment, that nothing of any launcher is left.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from client._client import Client
from gelastic.local import poll_until
from tests._etcd import EtcdServer
from tests._helpers import free_port
from tests.e2e.conftest import MARKER_ENV, PY, assert_nothing_left, gone, marked_processes

REPO = Path(__file__).resolve().parents[2]
DDP = str(REPO / "tests" / "workloads" / "ddp_nodes.py")
TORCH_LAUNCHER = REPO / "tests" / "workloads" / "torch_launcher"
RUN_TIMEOUT_S = 150.0
PRELOAD = ("--preload", "torch", "--preload", "torch._dynamo")
"""Forked workers: each launcher imports torch once, not once per worker and restart."""


class Launcher:
    """One `gelastic run` process: one node."""

    def __init__(self, tmp: Path, index: int, argv: list[str], env: dict[str, str]) -> None:
        self.dir = tmp / f"launcher{index}"
        (self.dir / "tmp").mkdir(parents=True)
        self.marker = uuid.uuid4().hex
        self.stdout = open(self.dir / "stdout", "w+")  # noqa: SIM115 (closed in finish)
        self.stderr = open(self.dir / "stderr", "w+")  # noqa: SIM115
        full = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "SLURM_"))}
        full.update(
            {MARKER_ENV: self.marker, "TMPDIR": str(self.dir / "tmp"), "PYTHONPATH": str(REPO)}
        )
        full.update(env)
        self.proc = subprocess.Popen(
            [PY, "-m", "gelastic", "run", *argv],
            stdout=self.stdout,
            stderr=self.stderr,
            env=full,
            cwd=self.dir,
            start_new_session=True,
        )

    def wait(self, timeout: float = RUN_TIMEOUT_S) -> int:
        return self.proc.wait(timeout)

    def kill(self) -> None:
        """SIGKILL the launcher's process group (the launcher and anything in its session)."""
        os.killpg(self.proc.pid, signal.SIGKILL)

    def err(self) -> str:
        self.stderr.flush()
        return (self.dir / "stderr").read_text()

    def out(self) -> str:
        self.stdout.flush()
        return (self.dir / "stdout").read_text()

    def finish(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
        self.stdout.close()
        self.stderr.close()


@pytest.fixture
def launchers(tmp_path: Path):  # type: ignore[no-untyped-def]
    started: list[Launcher] = []

    def start(argv: list[str], env: dict[str, str] | None = None) -> Launcher:
        launcher = Launcher(tmp_path, len(started), argv, env or {})
        started.append(launcher)
        return launcher

    yield start
    # Look before anything is killed: every launcher has ended by itself, and nothing of any
    # of them is left; only then are the ones still running (a failed test's) killed.
    running = [launcher for launcher in started if launcher.proc.poll() is None]
    try:
        for launcher in started:
            if launcher not in running:
                assert_nothing_left(launcher.marker)
        assert not running, [launcher.err()[-2000:] for launcher in running]
    finally:
        for launcher in started:
            launcher.finish()
        for launcher in running:
            assert_nothing_left(launcher.marker)


def c10d(n: str, port: int, run_id: str, *extra: str) -> list[str]:
    return [
        "--nnodes",
        n,
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        run_id,
        *extra,
    ]


def ddp_env(out: Path, **extra: str) -> dict[str, str]:
    out.mkdir(exist_ok=True)
    return {"NODES_OUT": str(out), **extra}


def params(out: Path, restart: int, world: int) -> list[float]:
    loaded: list[list[float]] = json.loads((out / f"params.{restart}.{world}.json").read_text())
    return [x for p in loaded for x in p]


def starts(out: Path, restart: int) -> dict[int, dict[str, int]]:
    return {
        int(p.name.split(".")[2]): json.loads(p.read_text()) for p in out.glob(f"start.{restart}.*")
    }


def step_of(out: Path) -> tuple[int, int, int]:
    try:
        restart, world, step = (out / "step").read_text().split()
    except (FileNotFoundError, ValueError):
        return (-1, -1, -1)
    return int(restart), int(world), int(step)


def test_three_launchers_form_one_3x2_ddp_job_that_trains_as_one_launcher(
    tmp_path: Path, launchers
) -> None:  # type: ignore[no-untyped-def]
    port, run_id = free_port(), uuid.uuid4().hex[:12]
    out = tmp_path / "three"
    # The torchrun line, unchanged, on every node.
    nodes = [launchers([*c10d("3", port, run_id), DDP], ddp_env(out)) for _ in range(3)]
    codes = [n.wait() for n in nodes]
    assert codes == [0, 0, 0], [n.err() for n in nodes]
    hosts = [n for n in nodes if "hosts the rendezvous" in n.err()]
    assert len(hosts) == 1, [n.err() for n in nodes]
    started = starts(out, 0)
    assert sorted(started) == [0, 1, 2, 3, 4, 5]
    assert {s["world"] for s in started.values()} == {6}
    assert sorted({s["group"] for s in started.values()}) == [0, 1, 2]
    one = tmp_path / "one"
    single = launchers(["--nproc-per-node", "6", *PRELOAD, DDP], ddp_env(one))
    assert single.wait() == 0, single.err()
    assert params(out, 0, 6) == pytest.approx(params(one, 0, 6), abs=1e-6)


def test_a_rank_crash_restarts_the_job_once_on_every_node(tmp_path: Path, launchers) -> None:  # type: ignore[no-untyped-def]
    port, run_id = free_port(), uuid.uuid4().hex[:12]
    out = tmp_path / "out"
    env = ddp_env(out, NODES_CRASH_RANK="3")
    argv = [*c10d("3", port, run_id, "--max-restarts", "1", *PRELOAD), DDP]
    nodes = [launchers(argv, env) for _ in range(3)]
    assert [n.wait() for n in nodes] == [0, 0, 0], [n.err() for n in nodes]
    # Attempt 1 ran on every node: all six ranks restarted with the count 1.
    assert sorted(starts(out, 1)) == [0, 1, 2, 3, 4, 5]
    assert (out / "params.1.6.json").exists() and not (out / "params.0.6.json").exists()


def test_a_non_host_launcher_killed_re_forms_the_job_without_a_restart(
    tmp_path: Path, launchers
) -> None:  # type: ignore[no-untyped-def]
    port, run_id = free_port(), uuid.uuid4().hex[:12]
    out = tmp_path / "out"
    env = ddp_env(out, NODES_STEPS="40", NODES_PAUSE="0.1")
    argv = [
        *c10d(
            "2:3",
            port,
            run_id,
            "--max-restarts",
            "0",
            "--rdzv-conf",
            "last_call_timeout=3",
            *PRELOAD,
        ),
        DDP,
    ]
    nodes = [launchers(argv, env) for _ in range(3)]
    poll_until(lambda: step_of(out)[2] >= 5, 120, what="attempt 0 training on 3 nodes")
    assert step_of(out)[:2] == (0, 6)
    host = next(n for n in nodes if "hosts the rendezvous" in n.err())
    victim = next(n for n in nodes if n is not host)
    doomed = [s["pid"] for r, s in starts(out, 0).items() if r >= 0]
    assert all(not gone(pid) for pid in doomed)  # every rank runs before the kill
    victim.kill()
    assert victim.wait(10) == -signal.SIGKILL
    rest = [n for n in nodes if n is not victim]
    assert [n.wait() for n in rest] == [0, 0], [n.err() for n in rest]
    # Re-formed on two nodes (world 4), still attempt 0: no restart was spent.
    assert (out / "params.0.4.json").exists(), [n.err() for n in rest]
    assert not marked_processes(victim.marker)


def test_a_non_host_launcher_sigtermed_drains_its_node_and_the_job_re_forms_without_a_restart(
    tmp_path: Path, launchers
) -> None:  # type: ignore[no-untyped-def]
    port, run_id = free_port(), uuid.uuid4().hex[:12]
    out = tmp_path / "out"
    env = ddp_env(out, NODES_STEPS="40", NODES_PAUSE="0.1")
    argv = [
        *c10d(
            "2:3",
            port,
            run_id,
            "--max-restarts",
            "0",
            "--rdzv-conf",
            "last_call_timeout=3",
            *PRELOAD,
        ),
        DDP,
    ]
    nodes = [launchers(argv, env) for _ in range(3)]
    poll_until(lambda: step_of(out)[2] >= 5, 120, what="attempt 0 training on 3 nodes")
    host = next(n for n in nodes if "hosts the rendezvous" in n.err())
    victim = next(n for n in nodes if n is not host)
    # What a pod eviction or a spot drain sends the launcher of one node.
    victim.proc.send_signal(signal.SIGTERM)
    assert victim.wait(60) == 1, victim.err()
    assert "this node leaves the job" in victim.err()
    rest = [n for n in nodes if n is not victim]
    assert [n.wait() for n in rest] == [0, 0], [n.err() for n in rest]
    # Re-formed on two nodes (world 4), still attempt 0: no restart was spent.
    assert (out / "params.0.4.json").exists(), [n.err() for n in rest]
    # Its node was drained through the coordinator: its workers got the preemption notice.
    (notice,) = (victim.dir / "tmp").glob("gelastic-run-*/*/attempt_0/preempt-*.json")
    assert "draining" in json.loads(notice.read_text())["reason"]
    assert not marked_processes(victim.marker)


def test_the_c10d_host_launcher_killed_ends_every_other_node_within_10s(
    tmp_path: Path, launchers
) -> None:  # type: ignore[no-untyped-def]
    port, run_id = free_port(), uuid.uuid4().hex[:12]
    out = tmp_path / "out"
    env = ddp_env(out, NODES_STEPS="10000", NODES_PAUSE="0.1")
    argv = [*c10d("3", port, run_id, *PRELOAD), DDP]
    nodes = [launchers(argv, env) for _ in range(3)]
    poll_until(lambda: step_of(out)[2] >= 3, 120, what="the job training")
    host = next(n for n in nodes if "hosts the rendezvous" in n.err())
    others = [n for n in nodes if n is not host]
    pids = [s["pid"] for s in starts(out, 0).values()]
    assert len(pids) == 6 and all(not gone(p) for p in pids)
    host.kill()
    killed = time.monotonic()
    codes = [n.wait(10) for n in others]
    assert time.monotonic() - killed < 10
    assert all(c not in (0, None) for c in codes), codes
    for n in others:
        assert "rendezvous host at 127.0.0.1" in n.err() and "is gone" in n.err(), n.err()
    poll_until(lambda: all(gone(p) for p in pids), 10, what="every worker gone")


def test_the_etcd_leader_launcher_killed_the_job_goes_on_and_finishes(
    tmp_path: Path, launchers
) -> None:  # type: ignore[no-untyped-def]
    etcd = EtcdServer(tmp_path / "etcd")
    etcd.start()
    try:
        run_id = uuid.uuid4().hex[:12]
        out = tmp_path / "out"
        env = ddp_env(out, NODES_STEPS="60", NODES_PAUSE="0.1")
        argv = [
            "--nnodes",
            "2:3",
            "--nproc-per-node",
            "2",
            "--rdzv-backend",
            "etcd",
            "--rdzv-endpoint",
            etcd.endpoint,
            "--rdzv-id",
            run_id,
            "--rdzv-conf",
            "last_call_timeout=3,leader_ttl=3",
            # The leader's node took its ranks along, and the others' gloo errors reach the new
            # leader before it knows that node is gone: still a lost node, no restart spent.
            "--max-restarts",
            "0",
            *PRELOAD,
            DDP,
        ]
        nodes = [launchers(argv, env) for _ in range(3)]
        poll_until(
            lambda: step_of(out)[:2] == (0, 6) and step_of(out)[2] >= 3,
            120,
            what="training on 3 nodes",
        )
        replicas = {}
        for n in nodes:
            line = next(x for x in n.err().splitlines() if "coordinator replica at" in x)
            replicas[line.split("replica at ")[1].split()[0]] = n
        with Client(",".join(replicas)) as client:
            client.list_nodes()
            leader = replicas[client.address]
        leader.kill()
        rest = [n for n in nodes if n is not leader]
        assert [n.wait() for n in rest] == [0, 0], [n.err() for n in rest]
        # Re-formed on the two others (world 4), attempt 0: the job outlived its leader's node.
        assert (out / "params.0.4.json").exists(), [n.err() for n in rest]
    finally:
        etcd.stop()


def test_launchers_whose_specs_differ_refuse_only_the_odd_one(tmp_path: Path, launchers) -> None:  # type: ignore[no-untyped-def]
    port, run_id = free_port(), uuid.uuid4().hex[:12]
    script = tmp_path / "echo.py"
    script.write_text("import os\nprint('rank', os.environ['RANK'], flush=True)\n")
    same = [*c10d("2", port, run_id, "--rdzv-conf", "is_host=true"), str(script), "--lr", "1"]
    host = launchers(same)
    poll_until(lambda: "hosts the rendezvous" in host.err(), 60, what="the host")
    odd = launchers([*c10d("2", port, run_id), str(script), "--lr", "2"])
    assert odd.wait(60) == 2
    assert (
        "differs from the job" in odd.err()
        and "args: ['--lr', '2'] here, ['--lr', '1'] in the job" in odd.err()
    ), odd.err()
    other = launchers(
        [*c10d("2", port, run_id, "--rdzv-conf", "is_host=false"), str(script), "--lr", "1"]
    )
    assert [host.wait(), other.wait()] == [0, 0], [host.err(), other.err()]


def test_the_pytorchjob_form_with_only_pet_variables_and_a_node_before_its_host(
    tmp_path: Path, launchers
) -> None:  # type: ignore[no-untyped-def]
    port, run_id = free_port(), uuid.uuid4().hex[:12]
    script = tmp_path / "echo.py"
    script.write_text(
        "import os\nprint('rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'], flush=True)\n"
    )
    pet = {
        "PET_NNODES": "2",
        "PET_NPROC_PER_NODE": "2",
        "PET_RDZV_BACKEND": "c10d",
        "PET_RDZV_ENDPOINT": f"127.0.0.1:{port}",
        "PET_RDZV_ID": run_id,
        "PET_MAX_RESTARTS": "1",
    }
    early = launchers([str(script)], {**pet, "PET_RDZV_CONF": "is_host=false,join_timeout=60"})
    poll_until(lambda: "joins the rendezvous" in early.err(), 30, what="the early node")
    assert early.proc.poll() is None  # it waits for a host that is not there yet
    host = launchers([str(script)], {**pet, "PET_RDZV_CONF": "is_host=true,join_timeout=60"})
    assert [early.wait(), host.wait()] == [0, 0], [early.err(), host.err()]
    lines = sorted(x for n in (early, host) for x in n.out().splitlines())
    assert lines == [f"[{r}]:rank {r} of 4" for r in range(4)]


def test_a_node_whose_host_never_comes_fails_after_join_timeout(tmp_path: Path, launchers) -> None:  # type: ignore[no-untyped-def]
    port = free_port()
    script = tmp_path / "t.py"
    script.write_text("pass\n")
    lone = launchers(
        [*c10d("2", port, "x", "--rdzv-conf", "is_host=false,join_timeout=2"), str(script)]
    )
    assert lone.wait(30) == 1
    assert f"no coordinator answered at 127.0.0.1:{port} within join_timeout (2 s)" in lone.err(), (
        lone.err()
    )


def test_launch_elastic_multiple_agents(tmp_path: Path, launchers) -> None:  # type: ignore[no-untyped-def]
    # torch's test_run.py test_launch_elastic_multiple_agents: two agents, --nnodes=1:2, one
    # rendezvous, each rank touches a file named after its global rank.
    port, run_id = free_port(), str(uuid.uuid4().int)
    touched = tmp_path / "touched"
    touched.mkdir()
    argv = [
        "--nnodes=1:2",
        "--nproc-per-node=2",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=localhost:{port}",
        "--rdzv-conf='join_timeout=5,last_call_timeout=5,timeout=5'",
        f"--rdzv-id={run_id}",
        "--monitor-interval=1",
        "--start-method=spawn",
        "--max-restarts=0",
        str(TORCH_LAUNCHER / "test_script.py"),
        f"--touch_file_dir={touched}",
    ]
    nodes = [launchers(argv, {"TEST_SENTINEL_PARENT": "FOOBAR"}) for _ in range(2)]
    assert [n.wait() for n in nodes] == [0, 0], [n.err() for n in nodes]
    assert {p.name for p in touched.iterdir()} == {"0", "1", "2", "3"}


def test_static_node_rank_zero_hosts_at_master_addr_and_port(tmp_path: Path, launchers) -> None:  # type: ignore[no-untyped-def]
    port = free_port()
    script = tmp_path / "echo.py"
    script.write_text(
        "import os\nprint('rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'], flush=True)\n"
    )
    static = [
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
    ]
    second = launchers([*static, "--node-rank", "1", str(script)])  # before its host, too
    first = launchers([*static, "--node-rank", "0", str(script)])
    assert [first.wait(), second.wait()] == [0, 0], [first.err(), second.err()]
    assert "hosts the rendezvous" in first.err() and "joins the rendezvous" in second.err()
    assert sorted(x for n in (first, second) for x in n.out().splitlines()) == [
        "[0]:rank 0 of 2",
        "[1]:rank 1 of 2",
    ]


def test_a_failed_job_ends_every_node_with_exit_1_and_the_root_cause(
    tmp_path: Path, launchers
) -> None:  # type: ignore[no-untyped-def]
    port, run_id = free_port(), uuid.uuid4().hex[:12]
    script = tmp_path / "fail.py"
    script.write_text(
        "import os, sys, time\n"
        "if os.environ['RANK'] == '3':\n"
        "    raise SystemExit('rank three gives up')\n"
        "time.sleep(60)\n"
    )
    nodes = [
        launchers([*c10d("2", port, run_id, "--max-restarts", "0"), str(script)]) for _ in range(2)
    ]
    assert [n.wait() for n in nodes] == [1, 1], [n.err() for n in nodes]
    for n in nodes:
        err = n.err()
        assert err.count("Root Cause (first observed failure)") == 1, err
        assert "rank      : 3 (local_rank: 1)" in err and "rank three gives up" in err, err


def test_a_node_that_comes_late_scales_the_job_up_to_max(tmp_path: Path, launchers) -> None:  # type: ignore[no-untyped-def]
    port, run_id = free_port(), uuid.uuid4().hex[:12]
    out = tmp_path / "out"
    out.mkdir()
    # Each rank writes its world size; in a world of 4 rank 0 says so and all finish.
    script = tmp_path / "grow.py"
    script.write_text(
        "import os, time\n"
        f"out = {str(out)!r}\n"
        "world, rank = os.environ['WORLD_SIZE'], os.environ['RANK']\n"
        "open(os.path.join(out, f'w{world}.r{rank}'), 'w').close()\n"
        "deadline = time.monotonic() + 60\n"
        "while world == '2' and time.monotonic() < deadline:\n"
        "    time.sleep(0.05)\n"
    )
    argv = [*c10d("1:2", port, run_id, "--rdzv-conf", "last_call_timeout=0.5"), str(script)]
    first = launchers(argv)
    poll_until(lambda: (out / "w2.r0").exists(), 60, what="the job running on the first node")
    late = launchers(argv)
    assert [first.wait(), late.wait()] == [0, 0], [first.err(), late.err()]
    assert {p.name for p in out.glob("w4.*")} == {"w4.r0", "w4.r1", "w4.r2", "w4.r3"}


def test_a_shared_token_admits_the_nodes_that_hold_it_only(tmp_path: Path, launchers) -> None:  # type: ignore[no-untyped-def]
    port, run_id = free_port(), uuid.uuid4().hex[:12]
    good, bad = tmp_path / "token", tmp_path / "other"
    for path, text in ((good, "a" * 64), (bad, "b" * 64)):
        path.write_text(text)
        path.chmod(0o600)
    script = tmp_path / "echo.py"
    script.write_text("import os\nprint('rank', os.environ['RANK'], flush=True)\n")
    argv = [*c10d("2", port, run_id), str(script)]
    host = launchers(
        [*argv[:-1], "--rdzv-conf", "is_host=true", str(script)], {"GELASTIC_TOKEN_FILE": str(good)}
    )
    poll_until(lambda: "hosts the rendezvous" in host.err(), 60, what="the host")
    stranger = launchers(argv, {"GELASTIC_TOKEN_FILE": str(bad)})
    assert stranger.wait(60) == 2
    assert f"refused this node, which holds the token in {bad}" in stranger.err(), stranger.err()
    member = launchers([*argv[:-1], "--rdzv-conf", f"token_file={good}", str(script)])
    assert [host.wait(), member.wait()] == [0, 0], [host.err(), member.err()]
    assert "no token" not in host.err() and "no token" not in member.err()
