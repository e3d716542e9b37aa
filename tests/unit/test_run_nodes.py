"""`gelastic run` on every node: what a node decides from torchrun's multi-node command line.

The runs themselves (several launchers forming one job) are in tests/e2e/test_run_nodes.py.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import pytest

from client.model import JobSpec, is_name
from client.spec_diff import spec_differences
from gelastic._cli_run import RunError, RunPlan, plan_run, run_parser
from gelastic._rdzv import (
    RdzvError,
    bind_address,
    default_node_name,
    endpoint_is_local,
    parse_endpoint,
    parse_rdzv_conf,
    request_id_for,
)


@pytest.fixture(autouse=True)
def _no_pet(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for k in list(os.environ):
        if k.startswith(("PET_", "SLURM_")) or k in ("PYTHON_EXEC", "GELASTIC_TOKEN_FILE"):
            monkeypatch.delenv(k)
    yield


SCRIPTS = ("t.py",)


@pytest.fixture(autouse=True)
def _scripts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # `gelastic run` checks that what it runs is there before it starts anything.
    monkeypatch.chdir(tmp_path)
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


C10D = ("--rdzv-backend", "c10d", "--rdzv-endpoint", "head:29511", "--rdzv-id", "job7")


def test_the_torchrun_c10d_line_is_a_node_of_a_multi_node_job() -> None:
    p = plan(
        "--nnodes",
        "2:4",
        "--nproc-per-node",
        "8",
        *C10D,
        "--max-restarts",
        "3",
        "t.py",
        "--lr",
        "1",
    )
    mn = p.multinode
    assert mn is not None
    assert (mn.backend, mn.host, mn.port, mn.run_id) == ("c10d", "head", 29511, "job7")
    assert mn.endpoint == "head:29511" and mn.request_id == "rdzv.job7"
    s = p.spec
    assert (s.min_nodes, s.max_nodes, s.nproc_per_node, s.max_restarts) == (2, 4, 8, 3)
    assert (s.last_call_timeout, s.join_timeout) == (30.0, 600.0)  # torch's c10d defaults
    # Nothing of one node's is in the spec every node submits.
    assert (s.master_addr, s.master_port, s.name) == ("", 0, "job7")
    assert not any("rdzv" in n for n in p.notes)


def test_the_same_line_through_pet_variables_as_a_pytorchjob_sets_them() -> None:
    p = plan(
        "t.py",
        PET_NNODES="1:3",
        PET_NPROC_PER_NODE="2",
        PET_RDZV_BACKEND="c10d",
        PET_RDZV_ENDPOINT="job-worker-0:23456",
        PET_RDZV_ID="job",
        PET_MAX_RESTARTS="2",
    )
    assert p.multinode is not None and p.multinode.endpoint == "job-worker-0:23456"
    assert (p.spec.min_nodes, p.spec.max_nodes, p.spec.max_restarts) == (1, 3, 2)
    assert (
        plan("--nnodes", "2", *C10D, "t.py").spec
        == plan(
            "t.py",
            PET_NNODES="2",
            PET_RDZV_BACKEND="c10d",
            PET_RDZV_ENDPOINT="head:29511",
            PET_RDZV_ID="job7",
        ).spec
    )


def test_c10d_takes_port_29400_by_default_and_rdzv_conf_sets_the_timeouts() -> None:
    p = plan(
        "--nnodes=2",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=head",
        "--rdzv-conf='join_timeout=5,last_call_timeout=1,timeout=5'",
        "t.py",
    )
    assert p.multinode is not None and p.multinode.port == 29400
    assert (p.spec.join_timeout, p.spec.last_call_timeout) == (5.0, 1.0)
    assert p.notes == ("ignoring --rdzv-conf timeout: torch's own rendezvous setting",)


def test_static_meets_at_master_addr_and_port_and_node_rank_zero_hosts() -> None:
    p = plan(
        "--nnodes",
        "2",
        "--master-addr",
        "10.0.0.1",
        "--master-port",
        "29501",
        "--node-rank",
        "1",
        "t.py",
    )
    mn = p.multinode
    assert mn is not None and (mn.backend, mn.endpoint, mn.node_rank) == (
        "static",
        "10.0.0.1:29501",
        1,
    )
    assert plan("--nnodes", "2", "--node-rank", "0", "t.py").multinode.endpoint == "127.0.0.1:29500"  # type: ignore[union-attr]
    assert "--node-rank must be 0-1" in refused("--nnodes", "2", "--node-rank", "2", "t.py")


def test_one_node_without_a_rendezvous_is_this_host_alone_as_before() -> None:
    for argv in (
        ("--nnodes", "1:4"),
        ("--standalone", "--nnodes", "1:2", *C10D),
        ("--nnodes", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:1"),
    ):
        p = plan(*argv, "t.py")
        if "--standalone" in argv:
            assert p.multinode is None
            continue
        assert p.multinode is None and (p.spec.min_nodes, p.spec.max_nodes) == (1, 1)
    assert "run the same line on every node" in refused("--nnodes", "2", "t.py")


def test_etcd_needs_its_own_rdzv_id_and_bad_settings_are_named() -> None:
    assert "needs --rdzv-id" in refused(
        "--nnodes", "2", "--rdzv-backend", "etcd", "--rdzv-endpoint", "e:2379", "t.py"
    )
    p = plan(
        "--nnodes",
        "2",
        "--rdzv-backend",
        "etcd-v2",
        "--rdzv-endpoint",
        "http://e",
        "--rdzv-id",
        "j",
        "t.py",
    )
    assert p.multinode is not None and p.multinode.etcd_store == "etcd://e:2379/gelastic-run/run-j"
    assert "--rdzv-backend must be" in refused(
        "--nnodes", "2", "--rdzv-backend", "zk", "--rdzv-endpoint", "h", "t.py"
    )
    assert "not a host name" in refused(
        "--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "a b:1", "t.py"
    )
    assert "unknown key 'bogus'" in refused(
        "--nnodes", "2", *C10D, "--rdzv-conf", "bogus=1", "t.py"
    )
    assert "does not exist" in refused(
        "--nnodes", "2", *C10D, "t.py", GELASTIC_TOKEN_FILE="/nonexistent/t"
    )


def test_rdzv_conf_is_bounded_and_typed() -> None:
    c = parse_rdzv_conf(
        "is_host=true, token_file=/s/t ,close_timeout=3,leader_ttl=2,replica_port=29700"
    )
    assert (c.is_host, c.token_file, c.close_timeout, c.leader_ttl, c.replica_port) == (
        True,
        "/s/t",
        3.0,
        2.0,
        29700,
    )
    assert parse_rdzv_conf("").is_host is None
    for bad in ("is_host=maybe", "join_timeout=-1", "x", "=1", "leader_ttl=0.1", "a=1," * 2000):
        with pytest.raises(RdzvError):
            parse_rdzv_conf(bad)


def test_endpoints_parse_as_torch_writes_them() -> None:
    assert parse_endpoint("[::1]:5", 1) == ("::1", 5)
    assert parse_endpoint("h", 29400) == ("h", 29400)
    for bad in ("h:0", "h:99999", "[::1", "h:x", "https://h:1"):
        with pytest.raises(RdzvError):
            parse_endpoint(bad, 1)


def test_node_names_tell_launchers_of_one_host_apart() -> None:
    assert default_node_name({}, "gpu-7.cluster.local", 4242) == "gpu-7-4242"
    assert default_node_name({"SLURM_PROCID": "3"}, "gpu-7", 4242) == "gpu-7-3"
    assert default_node_name({"SLURM_PROCID": "x;rm"}, "gpu-7", 4242) == "gpu-7-4242"
    assert is_name(default_node_name({}, "\x1b]52;", 9))


def test_every_node_of_a_run_submits_under_one_valid_key() -> None:
    assert request_id_for("job7") == request_id_for("job7") != request_id_for("job8")
    odd = request_id_for("a b/c" * 100)
    assert odd.startswith("rdzv.h") and len(odd) <= 128


def test_the_host_is_guessed_as_torch_guesses_it() -> None:
    def resolve(host: str) -> list[str]:
        return {"me": ["10.0.0.5"], "svc": ["10.96.0.1"], "other": ["10.0.0.9"]}.get(host, [])

    def bindable(addr: str) -> bool:
        return addr == "10.0.0.5"

    names = {"pod-0", "localhost"}
    assert endpoint_is_local("127.0.0.1", resolve=resolve, bindable=bindable, names=names)
    assert endpoint_is_local("me", resolve=resolve, bindable=bindable, names=names)
    assert endpoint_is_local("pod-0", resolve=resolve, bindable=bindable, names=names)
    assert not endpoint_is_local("other", resolve=resolve, bindable=bindable, names=names)
    assert bind_address("me", resolve=resolve, bindable=bindable) == "10.0.0.5"
    # A name that is this host's but resolves elsewhere (a Service): every interface.
    assert bind_address("svc", resolve=resolve, bindable=bindable) == "0.0.0.0"


def test_spec_differences_name_the_field_and_hide_secrets() -> None:
    a = JobSpec(entrypoint=["python", "t.py"], args=["--lr", "1", "--token=s3cret"], env={"K": "v"})
    b = JobSpec(
        entrypoint=["python", "u.py"],
        args=["--lr", "2", "--token=other"],
        env={"K": "w"},
        nproc_per_node=2,
    )
    lines = spec_differences(a, b)
    text = "\n".join(lines)
    assert [line.split(":")[0] for line in lines] == ["entrypoint", "args", "nproc_per_node", "env"]
    assert "'t.py'" in text and "'u.py'" in text and "1 here, 2 in the job" in text
    assert "s3cret" not in text and "other" not in text and "'v'" not in text and "'w'" not in text
    assert spec_differences(a, a) == []


def test_an_etcd_run_id_named_like_a_store_section_makes_a_valid_store() -> None:
    from coordinator._store_etcd import parse_etcd_url
    from coordinator.server import CoordinatorConfig

    for run_id in ("jobs", "nodes", "leader", "meta"):
        p = plan(
            "--nnodes",
            "2",
            "--rdzv-backend",
            "etcd",
            "--rdzv-endpoint",
            "e",
            "--rdzv-id",
            run_id,
            "t.py",
        )
        assert p.multinode is not None
        parse_etcd_url(p.multinode.etcd_store)
        CoordinatorConfig(store=p.multinode.etcd_store, insecure=True).etcd_settings()
