"""The launch plan: argv rewriting, the torchrun environment, log paths (pure, no processes)."""

from __future__ import annotations

import dataclasses
import pickle
import sys
from pathlib import Path

import pytest

from client.assignment import RoundAssignment, WorkerRanks
from client.model import JobSpec
from nodeagent._launch import (
    ARGS_MAGIC,
    BOOTSTRAP_PATH,
    STORE_HOST_PATH,
    attempt_dir,
    build_launch_plan,
    build_store_host_launch,
    find_attempt_dir,
    parse_python_command,
    resolve_attempt_dir,
    tee_prefix,
)

PY = "/opt/py/bin/python3.11"


def assignment(spec: JobSpec, *, attempt: int = 2, round_: int = 5) -> RoundAssignment:
    n = spec.nproc_per_node
    return RoundAssignment(
        job_id="job-7",
        round=round_,
        attempt=attempt,
        spec=spec,
        group_rank=1,
        group_world_size=3,
        master_addr="10.0.0.1",
        master_port=29511,
        workers=tuple(WorkerRanks(i, 4 + i, 10 + i, 3 * n, 30) for i in range(n)),
        run_id="run-abc",
    )


def plan(spec: JobSpec, **kw: object) -> list:  # type: ignore[type-arg]
    args: dict[str, object] = {
        "log_root": Path("/logs"),
        "node_name": "nodeA",
        "agent_env": {"PATH": "/bin", "HOME": "/root"},
        "python": PY,
        "agent_cwd": "/work",
    }
    args.update(kw)
    return build_launch_plan(assignment(spec), **args)  # type: ignore[arg-type]


def test_torchrun_env_is_complete() -> None:
    (w0, w1) = plan(JobSpec(entrypoint=["/bin/trainer", "--x"], nproc_per_node=2))
    env = w1.env
    assert {k: env[k] for k in env if k not in ("PATH", "HOME")} == {
        "RANK": "5",
        "LOCAL_RANK": "1",
        "GROUP_RANK": "1",
        "ROLE_RANK": "11",
        "ROLE_NAME": "default",
        "LOCAL_WORLD_SIZE": "2",
        "WORLD_SIZE": "6",
        "GROUP_WORLD_SIZE": "3",
        "ROLE_WORLD_SIZE": "30",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29511",
        "TORCHELASTIC_RESTART_COUNT": "2",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": "run-abc",
        "TORCHELASTIC_USE_AGENT_STORE": "False",
        "TORCHELASTIC_ERROR_FILE": "/logs/job-7/attempt_2/5/error.json",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "GELASTIC_JOB_ID": "job-7",
        "GELASTIC_ROUND": "5",
        "GELASTIC_NODE": "nodeA",
        "GELASTIC_PREEMPT_FILE": "/logs/job-7/attempt_2/preempt-nodeA.json",
        "GELASTIC_PROGRESS_FILE": "/logs/job-7/attempt_2/5/progress.json",
    }
    assert env["PATH"] == "/bin"
    assert w0.env["RANK"] == "4" and w0.env["LOCAL_RANK"] == "0"
    assert "TORCHELASTIC_TIMER_FILE" not in env


def test_timer_file_is_exported_when_given() -> None:
    (w,) = plan(JobSpec(entrypoint=["/bin/x"]), timer_file="/run/timer.fifo")
    assert w.env["TORCHELASTIC_TIMER_FILE"] == "/run/timer.fifo"


def test_user_env_wins_except_rank_variables() -> None:
    spec = JobSpec(
        entrypoint=["/bin/x"],
        env={
            "RANK": "99",
            "MASTER_PORT": "1",
            "OMP_NUM_THREADS": "8",
            "FOO": "bar",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",
            "TORCHELASTIC_ERROR_FILE": "/tmp/x",
        },
        nproc_per_node=2,
    )
    w = plan(spec, agent_env={"FOO": "agent", "PATH": "/bin"})[0]
    assert w.env["RANK"] == "4"
    assert w.env["MASTER_PORT"] == "29511"
    assert w.env["TORCHELASTIC_ERROR_FILE"].endswith("/4/error.json")
    assert w.env["OMP_NUM_THREADS"] == "8"
    assert w.env["FOO"] == "bar"
    assert w.env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"


def test_agent_env_defaults_kept_and_omp_only_with_several_workers() -> None:
    (w,) = plan(JobSpec(entrypoint=["/bin/x"]), agent_env={"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"})
    assert w.env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    assert "OMP_NUM_THREADS" not in w.env
    w2 = plan(JobSpec(entrypoint=["/bin/x"], nproc_per_node=2), agent_env={"OMP_NUM_THREADS": "4"})
    assert w2[0].env["OMP_NUM_THREADS"] == "4"


def test_binary_runs_as_is_with_local_rank_substituted() -> None:
    spec = JobSpec(
        entrypoint=["/bin/train"],
        args=["--dev=cuda:${local_rank}", "$local_rank", "$$"],
        nproc_per_node=2,
    )
    w = plan(spec)[1]
    # torchrun uses string.Template.safe_substitute on every argument but the program.
    assert w.argv == ("/bin/train", "--dev=cuda:1", "1", "$")
    assert w.program == "/bin/train"
    assert w.return_file is None and w.args_file is None and w.args_bytes is None


def test_python_script_goes_through_bootstrap_keeping_flags() -> None:
    spec = JobSpec(
        entrypoint=["python3", "-u", "-X", "dev", "-Wignore", "-OB", "train.py", "--lr", "1"]
    )
    (w,) = plan(spec)
    assert w.argv == (
        "python3",
        "-u",
        "-X",
        "dev",
        "-W",
        "ignore",
        "-O",
        "-B",
        BOOTSTRAP_PATH,
        "--error-file",
        "/logs/job-7/attempt_2/4/error.json",
        "--script",
        "train.py",
        "--",
        "--lr",
        "1",
    )
    assert w.program == "train.py"
    assert Path(BOOTSTRAP_PATH).is_file()


@pytest.mark.parametrize(
    ("argv", "mode", "target", "flags", "rest"),
    [
        (["python", "-m", "pkg.mod", "a"], "module", "pkg.mod", (), ("a",)),
        (["python3.11", "-mpkg", "-v"], "module", "pkg", (), ("-v",)),
        (["/usr/bin/python3", "-c", "print(1)", "x"], "code", "print(1)", (), ("x",)),
        (["python", "-Iuc", "pass"], "code", "pass", ("-I", "-u"), ()),
        (["python", "--", "s.py"], "script", "s.py", (), ()),
        (
            ["python", "-W", "error", "s.py", "-m", "x"],
            "script",
            "s.py",
            ("-W", "error"),
            ("-m", "x"),
        ),
        ([PY, "s.py"], "script", "s.py", (), ()),
        ([sys.executable, "s.py"], "script", "s.py", (), ()),
        (
            ["python", "--check-hash-based-pycs", "never", "s.py"],
            "script",
            "s.py",
            ("--check-hash-based-pycs", "never"),
            (),
        ),
    ],
)
def test_parse_python_command(
    argv: list[str], mode: str, target: str, flags: tuple[str, ...], rest: tuple[str, ...]
) -> None:
    parsed = parse_python_command(argv, python=PY)
    assert parsed is not None
    assert (parsed.mode, parsed.target, parsed.flags, parsed.args) == (mode, target, flags, rest)


@pytest.mark.parametrize(
    "argv",
    [
        ["python"],
        ["python", "-"],
        ["python", "-i", "s.py"],
        ["python", "--version"],
        ["python", "-c"],
        ["pythonista", "s.py"],
        ["/usr/bin/env", "python", "s.py"],
        ["bash", "-c", "echo"],
    ],
)
def test_not_hosted_by_bootstrap(argv: list[str]) -> None:
    assert parse_python_command(argv, python=PY) is None


def test_module_and_code_modes_in_plan() -> None:
    (w,) = plan(JobSpec(entrypoint=["python", "-m", "pkg.train"], args=["--rank=${local_rank}"]))
    assert w.argv[-4:] == ("--module", "pkg.train", "--", "--rank=0")
    (c,) = plan(JobSpec(entrypoint=["python", "-c", "print(1)"]))
    assert c.argv[-3:] == ("--code", "print(1)", "--")


def test_function_entrypoint() -> None:
    payload = pickle.dumps(((1,), {"y": 2}))
    spec = JobSpec(entrypoint="pkg.mod:fn", function_args=payload)
    (w,) = plan(spec)
    d = "/logs/job-7/attempt_2/4"
    assert w.argv == (
        PY,
        BOOTSTRAP_PATH,
        "--error-file",
        f"{d}/error.json",
        "--function",
        "pkg.mod:fn",
        "--args-file",
        f"{d}/args.pkl",
        "--return-file",
        f"{d}/return.pkl",
        "--",
    )
    assert w.args_bytes is not None and w.args_bytes.endswith(payload)
    assert w.args_bytes.startswith(ARGS_MAGIC)
    assert w.return_file == Path(d) / "return.pkl"
    assert w.is_function and w.program == "pkg.mod:fn"


def test_log_paths_cwd_and_masks() -> None:
    spec = JobSpec(entrypoint=["/bin/x"], nproc_per_node=2, redirects="0:1,1:3", tee="2", cwd="sub")
    w0, w1 = plan(spec, log_dir=Path("/logs/job-7/attempt_2.5"))
    assert w1.stdout_path == Path("/logs/job-7/attempt_2.5/5/stdout.log")
    assert w1.stderr_path == Path("/logs/job-7/attempt_2.5/5/stderr.log")
    assert w1.error_file == Path("/logs/job-7/attempt_2.5/5/error.json")
    assert w0.cwd == "/work/sub"
    assert (w0.redirect, w0.tee, w1.redirect, w1.tee) == (1, 2, 3, 2)
    assert w1.prefix == "[default1]:"
    abs_cwd = plan(JobSpec(entrypoint=["/bin/x"], cwd="/data"))[0]
    assert abs_cwd.cwd == "/data"


def test_tee_prefix_template() -> None:
    assert tee_prefix(None, role="trainer", local_rank=3, rank=7) == "[trainer3]:"
    assert tee_prefix("${rank}|${local_rank}> ", role="r", local_rank=3, rank=7) == "7|3> "


def test_attempt_dir_never_reuses_an_earlier_rounds_directory(tmp_path: Path) -> None:
    first = resolve_attempt_dir(tmp_path, "j", 0, 0)
    assert first == attempt_dir(tmp_path, "j", 0, 0, first_round_of_attempt=True)
    assert first.name == "attempt_0"
    first.mkdir(parents=True)
    # A peer agent of the same round may have made it without the marker yet.
    assert resolve_attempt_dir(tmp_path, "j", 0, 0) == first
    (first / "round").write_text("0\n")
    assert resolve_attempt_dir(tmp_path, "j", 0, 0) == first
    later = resolve_attempt_dir(tmp_path, "j", 0, 3)
    assert later.name == "attempt_0.3"
    assert resolve_attempt_dir(tmp_path, "j", 1, 4).name == "attempt_1"
    later.mkdir()
    assert find_attempt_dir(tmp_path, "j", 0, 0) == first
    assert find_attempt_dir(tmp_path, "j", 0, 3) == later
    assert find_attempt_dir(tmp_path, "j", 0, 9) is None


# ---- the workers' c10d store ----------------------------------------------------------------


def store_mode_on_every_node(spec: JobSpec, python: str = PY) -> set[str]:
    modes = set()
    for group_rank in range(3):
        a = dataclasses.replace(assignment(spec), group_rank=group_rank)
        launches = build_launch_plan(
            a, log_root=Path("/logs"), node_name=f"n{group_rank}", agent_env={}, python=python
        )
        modes |= {w.env["TORCHELASTIC_USE_AGENT_STORE"] for w in launches}
    return modes


@pytest.mark.parametrize(
    ("entrypoint", "mode"),
    [
        (["python", "train.py"], "True"),
        (["/venv/bin/python3.11", "-u", "-m", "pkg.train"], "True"),
        (["python3", "-c", "pass"], "True"),
        (["python", "-i", "train.py"], "True"),  # not hosted by the bootstrap, still python
        ("pkg.mod:fn", "True"),
        (["/bin/trainer", "--x"], "False"),
        (["bash", "-c", "python train.py"], "False"),
        (["torchrun", "train.py"], "False"),
    ],
)
def test_python_jobs_use_the_agent_store_on_every_node_others_let_rank_0_host_it(
    entrypoint: list[str] | str, mode: str
) -> None:
    assert store_mode_on_every_node(JobSpec(entrypoint=entrypoint, nproc_per_node=2)) == {mode}


def test_store_mode_depends_on_the_spec_not_on_this_nodes_interpreter() -> None:
    # A node whose own interpreter is /opt/py/bin/py runs the command through the bootstrap, but
    # nodes with another interpreter would not know it is python: all of them say False.
    spec = JobSpec(entrypoint=["/opt/py/bin/py", "train.py"])
    assert plan(spec, python="/opt/py/bin/py")[0].argv[1] == BOOTSTRAP_PATH
    assert store_mode_on_every_node(spec, python="/opt/py/bin/py") == {"False"}
    assert store_mode_on_every_node(spec) == {"False"}


def test_the_spec_env_can_opt_out_of_the_agent_store() -> None:
    spec = JobSpec(entrypoint=["python", "train.py"], env={"TORCHELASTIC_USE_AGENT_STORE": "False"})
    assert store_mode_on_every_node(spec) == {"False"}
    a = dataclasses.replace(assignment(spec), group_rank=0)
    assert build_store_host_launch(a, log_dir=Path("/l"), node_name="n", agent_env={}) is None


def test_only_group_rank_0_of_a_python_job_hosts_the_store() -> None:
    python_job = JobSpec(entrypoint=["python", "train.py"])
    kw: dict[str, object] = {"log_dir": Path("/l"), "node_name": "n", "agent_env": {}}
    leader = dataclasses.replace(assignment(python_job), group_rank=0)
    assert build_store_host_launch(leader, **kw) is not None  # type: ignore[arg-type]
    follower = dataclasses.replace(assignment(python_job), group_rank=1)
    assert build_store_host_launch(follower, **kw) is None  # type: ignore[arg-type]
    binary = dataclasses.replace(assignment(JobSpec(entrypoint=["/bin/x"])), group_rank=0)
    assert build_store_host_launch(binary, **kw) is None  # type: ignore[arg-type]


def test_store_host_runs_like_the_workers_without_their_identity() -> None:
    spec = JobSpec(
        entrypoint=["python3", "-X", "dev", "-u", "train.py", "--lr", "1"],
        env={"PYTHONPATH": "/src", "FOO": "spec"},
        cwd="sub",
        nproc_per_node=2,
    )
    a = dataclasses.replace(assignment(spec), group_rank=0)
    agent_env = {"PATH": "/bin", "FOO": "agent", "VIRTUAL_ENV": "/venv"}
    host = build_store_host_launch(
        a,
        log_dir=Path("/logs/job-7/attempt_2"),
        node_name="nodeA",
        agent_env=agent_env,
        python=PY,
        agent_cwd="/work",
    )
    assert host is not None
    (w0, _) = build_launch_plan(
        a,
        log_root=Path("/logs"),
        node_name="nodeA",
        agent_env=agent_env,
        python=PY,
        agent_cwd="/work",
    )
    # The workers' interpreter and its flags: the same torch, found the same way.
    # (Plus -S: the host runs site itself, later, at a low priority: --site.)
    assert host.argv == ("python3", "-X", "dev", "-u", "-S", STORE_HOST_PATH, "--site")
    assert Path(STORE_HOST_PATH).is_file()
    assert host.cwd == w0.cwd == "/work/sub"
    assert (host.addr, host.port) == ("10.0.0.1", 29511)
    assert host.log_path == Path("/logs/job-7/attempt_2/c10d_store.log")
    assert host.env == {
        "PATH": "/bin",
        "VIRTUAL_ENV": "/venv",
        "PYTHONPATH": "/src",
        "FOO": "spec",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29511",
        "TORCHELASTIC_RUN_ID": "run-abc",
        "GELASTIC_JOB_ID": "job-7",
        "GELASTIC_ROUND": "5",
        "GELASTIC_NODE": "nodeA",
    }
    shared = {k: v for k, v in w0.env.items() if k in host.env}
    assert shared == host.env


def test_function_store_host_uses_the_agents_python() -> None:
    a = dataclasses.replace(assignment(JobSpec(entrypoint="pkg.mod:fn")), group_rank=0)
    host = build_store_host_launch(a, log_dir=Path("/l"), node_name="n", agent_env={}, python=PY)
    assert host is not None and host.argv == (PY, "-S", STORE_HOST_PATH, "--site")


def test_only_a_job_with_torch_metrics_gets_the_agents_metrics_channel() -> None:
    agent = {"GELASTIC_TORCH_METRICS": "/agent/m.fifo"}
    mine = {"GELASTIC_TORCH_METRICS": "/tmp/elsewhere"}
    (on,) = plan(JobSpec(entrypoint=["/bin/x"], torch_metrics=True, env=mine), agent_env=agent)
    (off,) = plan(JobSpec(entrypoint=["/bin/x"], env=mine), agent_env=agent)
    (none,) = plan(JobSpec(entrypoint=["/bin/x"], torch_metrics=True), agent_env={})
    assert on.env["GELASTIC_TORCH_METRICS"] == "/agent/m.fifo"  # never a path the job names
    assert "GELASTIC_TORCH_METRICS" not in off.env
    assert "GELASTIC_TORCH_METRICS" not in none.env


def test_a_job_run_without_site_gets_a_store_host_without_site() -> None:
    spec = JobSpec(entrypoint=["python3", "-S", "train.py"], nproc_per_node=1)
    a = dataclasses.replace(assignment(spec), group_rank=0)
    host = build_store_host_launch(a, log_dir=Path("/l"), node_name="n", agent_env={}, python=PY)
    assert host is not None and host.argv == ("python3", "-S", STORE_HOST_PATH)
