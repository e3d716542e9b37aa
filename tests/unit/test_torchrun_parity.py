"""torchrun parity of `gelastic run`'s command line and of JobSpec's WorkerSpec fields.

The PET_* list is checked against the torch that is installed (its run.py read as text, torch
not imported); the Std forms are checked with torch's real `Std`.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import pytest

from client.model import JobSpec, SpecError
from client.wire import spec_from_pb, spec_to_pb
from coordinator._cluster import RequestPort
from gelastic._cli_run import PET_NAMES, RunError, RunPlan, cpu_count, plan_run, run_parser
from nodeagent._launch import build_launch_plan, build_store_host_launch, entrypoint_name
from tests.unit._cluster_driver import Driver, nodes_of
from tests.unit.test_launch import assignment
from tests.unit.test_launch import plan as launch_plan


@pytest.fixture(autouse=True)
def _no_pet(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for k in list(os.environ):
        if k.startswith("PET_") or k == "PYTHON_EXEC":
            monkeypatch.delenv(k)
    yield


SCRIPTS = ("x.py", "run.sh", "x.sh")


@pytest.fixture(autouse=True)
def _scripts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # `gelastic run` checks that what it runs is there before it starts anything.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}")
    for name in SCRIPTS:
        (tmp_path / name).write_text("")
        (tmp_path / name).chmod(0o755)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "mod.py").write_text("")


def plan(*argv: str, **env: str) -> RunPlan:
    with mock.patch.dict(os.environ, env):
        return plan_run(run_parser().parse_args(list(argv)))


def refused(*argv: str, **env: str) -> str:
    with pytest.raises(RunError) as e:
        plan(*argv, **env)
    return str(e.value)


# ---- PET_* ----------------------------------------------------------------------------------


def _torch_run_py() -> str:
    found = importlib.util.find_spec("torch")
    if found is None or found.origin is None:
        pytest.skip("torch is not installed")
    return (Path(found.origin).parent / "distributed" / "run.py").read_text()


def test_every_pet_name_torchrun_reads_is_read() -> None:
    # Every add_argument(...) of torch's parser with action=env/check_env: its dest, upper-cased.
    names = set()
    for call in re.findall(r"parser\.add_argument\((.*?)\n    \)", _torch_run_py(), re.S):
        if not re.search(r"action=(env|check_env)\b", call):
            continue
        longs = re.findall(r'"--([a-z][a-z0-9-]*)"', call)
        names.add("PET_" + max(longs, key=len).replace("-", "_").upper())
    assert len(names) >= 25
    assert names == set(PET_NAMES)


def test_the_pet_defaults_are_used() -> None:
    p = plan(
        "x.py",
        PET_NPROC_PER_NODE="3",
        PET_MAX_RESTARTS="2",
        PET_ROLE="trainer",
        PET_REDIRECTS="1",
        PET_TEE="0:2,1:0",
        PET_SHUTDOWN_TIMEOUT="7",
        PET_LOG_DIR="/tmp/x",
        PET_MASTER_PORT="29511",
        PET_MASTER_ADDR="node-a.example",
    )
    s = p.spec
    assert (s.nproc_per_node, s.max_restarts, s.role, s.stop_grace) == (3, 2, "trainer", 7.0)
    assert (s.redirects, s.tee, p.log_dir) == ("1", "0:2,1:0", "/tmp/x")
    assert (s.master_addr, s.master_port) == ("node-a.example", 29511)
    # The command line wins over the environment, as torchrun's env action does.
    assert plan("--nproc-per-node", "1", "x.py", PET_NPROC_PER_NODE="3").spec.nproc_per_node == 1


@pytest.mark.parametrize("value", ["1", "true", "True", " 2 "])
def test_a_pet_flag_that_is_set(value: str) -> None:
    assert plan("run.sh", PET_NO_PYTHON=value).spec.entrypoint == ("run.sh",)
    assert plan("pkg.mod", PET_MODULE=value).spec.entrypoint[-2:] == ("-m", "pkg.mod")


@pytest.mark.parametrize("value", ["0", "false", ""])
def test_a_pet_flag_that_is_not_set(value: str) -> None:
    assert plan("run.sh", PET_NO_PYTHON=value).spec.entrypoint == (sys.executable, "-u", "run.sh")


def test_a_pet_flag_that_is_not_a_boolean_is_refused() -> None:
    assert "PET_NO_PYTHON must be 0, 1, true or false" in refused("x", PET_NO_PYTHON="maybe")


def test_module_and_no_python_together_are_refused_and_run_path_wins() -> None:
    assert "--no-python" in refused("x", PET_NO_PYTHON="1", PET_MODULE="1")
    script = os.path.abspath("x.py")
    p = plan("--run-path", "--no-python", script)
    assert p.spec.entrypoint == (sys.executable, "-u", script)


def test_python_exec_is_the_interpreter_of_python_scripts() -> None:
    assert (
        plan("x.py", PYTHON_EXEC="/opt/py/bin/python3").spec.entrypoint[0] == "/opt/py/bin/python3"
    )
    assert plan("--no-python", "x.sh", PYTHON_EXEC="/opt/py").spec.entrypoint == ("x.sh",)


# ---- --nnodes, --nproc-per-node ---------------------------------------------------------------


def test_nnodes_one_to_n_runs_with_the_one_node() -> None:
    for value in ("1", "1:1", "1:2", "1:64"):
        s = plan("--nnodes", value, "x.py").spec
        assert (s.min_nodes, s.max_nodes) == (1, 1)
    # MIN above 1 needs the other nodes: a rendezvous to meet at (tests/unit/test_run_nodes.py).
    assert "run the same line on every node" in refused("--nnodes", "2:4", "x.py")
    assert "0 < MIN <= MAX" in refused("--nnodes", "0:1", "x.py")
    assert "0 < MIN <= MAX" in refused("--nnodes", "2:1", "x.py")


def test_nproc_cpu_counts_the_cpus_this_process_may_use() -> None:
    assert plan("--nproc-per-node", "cpu", "x.py").spec.nproc_per_node == cpu_count()
    assert "unsupported value 'unknown'" in refused("--nproc-per-node", "unknown", "x.py")
    assert "at least 1" in refused("--nproc-per-node", "0", "x.py")


def test_nproc_auto_and_device_names_follow_torch_accelerator() -> None:
    torch = pytest.importorskip("torch")
    with mock.patch("torch.accelerator.is_available", return_value=False):
        assert plan("--nproc-per-node", "auto", "x.py").spec.nproc_per_node == cpu_count()
    with (
        mock.patch("torch.accelerator.is_available", return_value=True),
        mock.patch("torch.accelerator.device_count", return_value=3),
    ):
        assert plan("--nproc-per-node", "auto", "x.py").spec.nproc_per_node == 3
    with (
        mock.patch("torch.xpu.is_available", return_value=True),
        mock.patch("torch.xpu.device_count", return_value=3),
    ):
        assert plan("--nproc-per-node", "xpu", "x.py").spec.nproc_per_node == 3
    if not torch.cuda.is_available():
        assert "CUDA is not available" in refused("--nproc-per-node", "gpu", "x.py")


# ---- refused and accepted torchrun flags ------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "env", "flag"),
    [
        (["--logs-specs", "custom"], {}, "--logs-specs"),
        (["--numa-binding", "node"], {}, "--numa-binding"),
        (["--node-rank", "1"], {}, "--node-rank"),
        ([], {"PET_NODE_RANK": "2"}, "--node-rank"),
        (["--rdzv-endpoint", "head:29400", "--rdzv-backend", "static"], {}, "--rdzv-endpoint"),
        (["--virtual-local-rank"], {}, "--virtual-local-rank"),
        ([], {"PET_VIRTUAL_LOCAL_RANK": "1"}, "--virtual-local-rank"),
        (["--event-log-handler", "console"], {}, "--event-log-handler"),
        (["--signals-to-handle", "SIGTERM,SIGUSR1"], {}, "--signals-to-handle"),
        (["--duplicate-stdout-filters", "loss"], {}, "--duplicate-stdout-filters"),
        ([], {"PET_DUPLICATE_STDERR_FILTERS": "a,b"}, "--duplicate-stderr-filters"),
    ],
)
def test_a_flag_this_command_cannot_honour_is_refused(
    argv: list[str], env: dict[str, str], flag: str
) -> None:
    assert refused(*argv, "x.py", **env).startswith(f"{flag} is not supported: ")


def test_torchrun_defaults_of_refused_flags_are_accepted() -> None:
    p = plan(
        "--node-rank=0",
        "--rdzv-endpoint=localhost:29400",
        "--event-log-handler=null",
        "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        "--duplicate-stdout-filters=",
        "--rdzv-backend=c10d",
        "--standalone",
        "x.py",
    )
    assert p.notes == (
        "ignoring --rdzv-backend: on one host the embedded coordinator is the rendezvous "
        "(several nodes: c10d, static or etcd)",
    )


@pytest.mark.parametrize("flag", ["--logs-specs", "--logs_specs"])
def test_logs_specs_default_torchruns_own_value_is_accepted(flag: str) -> None:
    # torchrun resolves "default" through its "torchrun.logs_specs" entry point: the default.
    assert plan(flag, "default", "x.py").notes == ()
    assert plan(f"{flag}=default", "x.py").spec.argv[-1].endswith("x.py")
    assert refused(flag, "defaults", "x.py").startswith("--logs-specs is not supported: ")


@pytest.mark.parametrize("flag", ["--use-env", "--use_env"])
def test_use_env_of_torch_distributed_launch_is_accepted_and_changes_nothing(flag: str) -> None:
    assert plan(flag, "x.py", "--lr", "1").spec.args == ("--lr", "1")


def test_no_use_env_gives_the_script_local_rank_as_torch_distributed_launch() -> None:
    spec = plan("--no-use-env", "--nproc-per-node", "2", "x.py", "--lr", "1").spec
    assert list(spec.args) == ["--local-rank=${local_rank}", "--lr", "1"]
    # Each worker gets its own local rank, where torch's launcher puts it: first.
    for launch in launch_plan(spec):
        tail = list(launch.argv[launch.argv.index(f"--local-rank={launch.local_rank}") :])
        assert tail == [f"--local-rank={launch.local_rank}", "--lr", "1"]
    assert "--use-env or --no-use-env" in refused("--no-use-env", "--use_env", "x.py")
    assert "--no-python" in refused("--no_use_env", "--no-python", "run.sh")


def test_unknown_flags_are_refused_by_the_parser() -> None:
    with pytest.raises(SystemExit) as e:
        run_parser().parse_args(["--bogus", "x.py"])
    assert e.value.code == 2


def test_master_addr_port_and_local_addr_map_to_the_spec() -> None:
    p = plan("--master-addr", "[::1]", "--master-port", "29511", "x.py")
    assert (p.spec.master_addr, p.spec.master_port) == ("::1", 29511)
    p = plan("--local-addr", "127.0.0.2", "x.py")
    assert (p.local_addr, p.spec.master_addr, p.spec.master_port) == ("127.0.0.2", "127.0.0.2", 0)
    assert "--master-port must be 1-65535" in refused("--master-port", "70000", "x.py")
    assert "master_addr" in refused("--master-addr", "bad host!", "x.py")
    # A name glibc's resolver takes from /etc/hosts, underscore and all.
    assert plan("--master-addr", "test_host", "x.py").spec.master_addr == "test_host"
    assert "master_addr" in refused("--master-addr=-test_host", "x.py")


# ---- JobSpec: redirects / tee in torch's forms --------------------------------------------------


def test_std_values_ints_and_dicts_are_kept_in_the_string_form() -> None:
    pytest.importorskip("torch")
    from torch.distributed.elastic.multiprocessing import Std

    cases = [
        (Std.ALL, "3"),
        (Std.NONE, "0"),
        (Std.OUT, "1"),
        (2, "2"),
        ({0: Std.OUT, 1: Std.ERR}, "0:1,1:2"),
        ({1: 3, 0: 0}, "0:0,1:3"),
        ("0:1,1:2", "0:1,1:2"),
        (Std.from_str("0:3,1:1"), "0:3,1:1"),
    ]
    for value, wire in cases:
        s = JobSpec(entrypoint=["python", "t.py"], nproc_per_node=2, redirects=value, tee=value)  # type: ignore[arg-type]
        s.validate()
        assert (s.redirects, s.tee) == (wire, wire), value
        back = spec_from_pb(spec_to_pb(s))
        assert (back.redirects, back.tee) == (wire, wire)


@pytest.mark.parametrize(
    "value", [4, -1, True, 1.5, None, {0: 4}, {"0": 1}, {0: True}, [1, 2], object()]
)
@pytest.mark.parametrize("name", ["redirects", "tee"])
def test_anything_else_is_a_spec_error_naming_the_field(name: str, value: object) -> None:
    s = JobSpec(entrypoint=["python", "t.py"], **{name: value})  # type: ignore[arg-type]
    with pytest.raises(SpecError) as e:
        s.validate()
    assert e.value.field == name


# ---- JobSpec: a fixed master address and port ----------------------------------------------------


@pytest.mark.parametrize(
    "addr",
    ["10.0.0.1", "::1", "node-a", "node-a.example.com", "[fe80::1]", "test_host", "_srv.node_a"],
)
def test_good_master_addrs(addr: str) -> None:
    s = JobSpec(entrypoint=["python", "t.py"], master_addr=addr, master_port=29500)
    s.validate()
    assert spec_from_pb(spec_to_pb(s)).master_addr == addr.strip("[]")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("master_addr", "a b"),
        ("master_addr", "x" * 254),
        ("master_addr", "-lead.example"),
        ("master_addr", "a_" + "b" * 62),
        ("master_addr", "node-a.-b"),
        ("master_addr", "host\n"),
        ("master_addr", 7),
        ("master_port", 65536),
        ("master_port", -1),
        ("master_port", True),
        ("master_port", "29500"),
    ],
)
def test_bad_master_addr_or_port_is_a_spec_error(field: str, value: object) -> None:
    s = JobSpec(entrypoint=["python", "t.py"], **{field: value})  # type: ignore[arg-type]
    with pytest.raises(SpecError) as e:
        s.validate()
    assert e.value.field == field


def test_a_fixed_port_is_assigned_without_a_reservation() -> None:
    d = Driver()
    d.connect("a", addr="10.0.0.1")
    d.connect("b", addr="10.0.0.2")
    d.submit("j", min_nodes=2, max_nodes=2, master_port=29511, master_addr="10.9.9.9")
    d.settle()
    assert nodes_of(d.history, RequestPort) == []
    for n in ("a", "b"):
        a = d.assignment(n)
        assert (a.master_addr, a.master_port) == ("10.9.9.9", 29511)
    # Without one, group rank 0 reserves a port, and its address is the master's.
    d = Driver()
    d.connect("a", addr="10.0.0.1")
    d.connect("b", addr="10.0.0.2")
    d.submit("k", min_nodes=2, max_nodes=2)
    d.settle()
    assert nodes_of(d.history, RequestPort) == ["a"]
    assert d.assignment("b", "k").master_addr == "10.0.0.1"


# ---- the agent: PYTHON_EXEC and the entrypoint's name -------------------------------------------


def test_python_exec_in_the_jobs_env_is_the_interpreter_of_function_workers() -> None:
    spec = JobSpec(entrypoint="pkg.mod:train", env={"PYTHON_EXEC": "/opt/venv/bin/python"})
    a = assignment(spec)
    kw = {"node_name": "n", "agent_env": {"PATH": "/bin"}, "python": "/usr/bin/python3"}
    (w,) = build_launch_plan(a, log_root=Path("/logs"), **kw)  # type: ignore[arg-type]
    assert w.argv[0] == "/opt/venv/bin/python"
    # The agent's own PYTHON_EXEC, when the job's env has none.
    plain = JobSpec(entrypoint="pkg.mod:train")
    agent = {"PATH": "/bin", "PYTHON_EXEC": "/opt/agent/python"}
    (w,) = build_launch_plan(assignment(plain), log_root=Path("/l"), node_name="n", agent_env=agent)
    assert w.argv[0] == "/opt/agent/python"
    (w,) = build_launch_plan(assignment(plain), log_root=Path("/l"), node_name="n", agent_env={})
    assert w.argv[0] == sys.executable
    rank0 = assignment(spec)
    object.__setattr__(rank0, "group_rank", 0)
    host = build_store_host_launch(rank0, log_dir=Path("/l"), node_name="n", agent_env={})
    assert host is not None and host.argv[0] == "/opt/venv/bin/python"


@pytest.mark.parametrize(
    ("entrypoint", "name"),
    [
        (["python", "-u", "/abs/dir/train.py", "--lr", "1"], "train.py"),
        (["/usr/bin/python3", "-u", "-m", "pkg.trainer"], "pkg.trainer"),
        (["python", "-c", "print(1)"], "-c"),
        (["/opt/bin/trainer", "--x"], "trainer"),
        ("pkg.mod:Trainer.fit", "fit"),
        (["./run\nme.sh"], "run?me.sh"),
    ],
)
def test_entrypoint_name_follows_torch(entrypoint: object, name: str) -> None:
    assert entrypoint_name(JobSpec(entrypoint=entrypoint)) == name  # type: ignore[arg-type]
