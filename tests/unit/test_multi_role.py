"""Multi-role jobs: the spec's roles, their wire form, and the rounds the coordinator forms with
them (placement per role, ranks as torch's own agent assigns them, one restart budget)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from client.model import MAX_ROLES, JobSpec, Role, SpecError, roles_from_json
from client.wire import _shown_spec_pb, spec_from_pb, spec_to_pb
from coordinator._cluster import AssignRound, StopRound
from coordinator._codec import decode, encode
from protos.gelastic.v1 import gelastic_pb2 as pb
from tests._torch_ranks import torch_ranks

from ._cluster_driver import Driver, of_type

PS = Role("ps", ["python", "ps.py"], nproc_per_node=1, min_nodes=1, max_nodes=1)
TRAINER = Role(
    "trainer", ["python", "train.py"], args=["--lr", "0.1"], nproc_per_node=2, max_nodes=2
)


def _spec(*roles: Role, **kw: Any) -> JobSpec:
    s = JobSpec(roles=roles or (PS, TRAINER), **kw)
    s.validate()
    return s


# ---- the spec -------------------------------------------------------------------------------


def test_roles_set_the_job_totals() -> None:
    s = _spec()
    assert (s.min_nodes, s.max_nodes, s.nproc_per_node) == (2, 3, 2)
    t = s.for_role("trainer")
    assert t.roles == ()
    assert (t.role, t.argv, t.nproc_per_node, t.min_nodes, t.max_nodes) == (
        "trainer",
        ("python", "train.py", "--lr", "0.1"),
        2,
        1,
        2,
    )
    t.validate()


def test_role_env_goes_over_the_job_env() -> None:
    s = _spec(PS, dataclasses.replace(TRAINER, env={"B": "role"}), env={"A": "job", "B": "job"})
    assert s.for_role("trainer").env == {"A": "job", "B": "role"}
    assert s.for_role("ps").env == {"A": "job", "B": "job"}


def test_a_single_role_spec_is_its_own_role() -> None:
    s = JobSpec(entrypoint=["true"], role="worker")
    assert s.for_role("worker") is s
    with pytest.raises(SpecError):
        s.for_role("ps")


@pytest.mark.parametrize(
    ("roles", "kw", "field"),
    [
        ((PS, dataclasses.replace(TRAINER, nproc_per_node=0)), {}, "roles[1].nproc_per_node"),
        ((PS, dataclasses.replace(TRAINER, min_nodes=3)), {}, "roles[1].min_nodes"),
        ((PS, dataclasses.replace(TRAINER, max_nodes=0)), {}, "roles[1].max_nodes"),
        ((PS, dataclasses.replace(TRAINER, name="ps")), {}, "roles[1].name"),
        ((dataclasses.replace(PS, name="a b"), TRAINER), {}, "roles[0].name"),
        ((dataclasses.replace(PS, name="x\n"), TRAINER), {}, "roles[0].name"),
        ((dataclasses.replace(PS, entrypoint=()), TRAINER), {}, "roles[0].entrypoint"),
        ((dataclasses.replace(PS, entrypoint=("",)), TRAINER), {}, "roles[0].entrypoint"),
        ((PS, dataclasses.replace(TRAINER, args=("a\x00",))), {}, "roles[1].args"),
        ((PS, dataclasses.replace(TRAINER, env={"A=B": "x"})), {}, "roles[1].env"),
        ((PS, dataclasses.replace(TRAINER, env={"A": "x\x00"})), {}, "roles[1].env"),
        ((PS, TRAINER), {"entrypoint": ["python", "x.py"]}, "entrypoint"),
        ((PS, TRAINER), {"entrypoint": "pkg.mod:fn"}, "entrypoint"),
        ((PS, dataclasses.replace(TRAINER, max_nodes=100_000)), {}, "roles"),
        (tuple(Role(f"r{i}", ["true"]) for i in range(MAX_ROLES + 1)), {}, "roles"),
    ],
)
def test_bad_roles_name_the_field(roles: tuple[Role, ...], kw: dict[str, Any], field: str) -> None:
    with pytest.raises(SpecError) as exc:
        JobSpec(roles=roles, **kw).validate()
    assert exc.value.field == field, exc.value


def test_a_role_runs_a_command_not_a_function() -> None:
    bad = Role("ps", print)  # type: ignore[arg-type]
    with pytest.raises(SpecError) as exc:
        JobSpec(roles=(bad,)).validate()
    assert exc.value.field == "roles[0].entrypoint"


def test_role_and_job_env_together_are_bounded() -> None:
    job_env = {f"J{i}": "x" for i in range(1000)}
    role = dataclasses.replace(TRAINER, env={f"R{i}": "x" for i in range(100)})
    with pytest.raises(SpecError) as exc:
        JobSpec(roles=(PS, role), env=job_env).validate()
    assert exc.value.field == "roles[1].env"


def test_roles_from_json() -> None:
    doc = [
        {"name": "ps", "entrypoint": ["python", "ps.py"]},
        {
            "name": "trainer",
            "entrypoint": ["python", "train.py"],
            "args": ["--lr", "0.1"],
            "env": {"X": "1"},
            "nproc_per_node": 2,
            "min_nodes": 1,
            "max_nodes": 2,
        },
    ]
    roles = roles_from_json(json.dumps(doc))
    assert roles == (PS, dataclasses.replace(TRAINER, env={"X": "1"}))
    JobSpec(roles=roles).validate()


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("{", "roles"),
        ("[]", "roles"),
        ('{"name": "ps"}', "roles"),
        ('["ps"]', "roles[0]"),
        ('[{"entrypoint": ["x"]}]', "roles[0].name"),
        ('[{"name": "ps", "entrypoint": ["x"], "nprocs": 2}]', "roles[0].nprocs"),
        ('[{"name": "ps", "entrypoint": {"a": 1}}]', "roles[0].entrypoint"),
        ('[{"name": "ps", "entrypoint": ["x"], "env": []}]', "roles[0].env"),
        (json.dumps([{"name": f"r{i}", "entrypoint": ["x"]} for i in range(17)]), "roles"),
        ("[" + " " * (1024 * 1024) + "]", "roles"),
    ],
)
def test_bad_roles_json_names_the_field(text: str, field: str) -> None:
    with pytest.raises(SpecError) as exc:
        roles_from_json(text)
    assert exc.value.field == field, exc.value


def test_roles_from_json_checked_by_validate() -> None:
    roles = roles_from_json(
        '[{"name": "ps", "entrypoint": ["x"]}, {"name": "t", "nproc_per_node": "2", "entrypoint": ["y"]}]'
    )
    with pytest.raises(SpecError) as exc:
        JobSpec(roles=roles).validate()
    assert exc.value.field == "roles[1].nproc_per_node"


# ---- wire and stored forms ------------------------------------------------------------------


def test_wire_round_trip() -> None:
    s = _spec(env={"A": "1"}, max_restarts=2)
    back = spec_from_pb(pb.JobSpec.FromString(spec_to_pb(s).SerializeToString()))
    back.validate()
    assert back == s


def test_stored_round_trip() -> None:
    s = _spec()
    assert decode(JobSpec, json.loads(json.dumps(encode(s)))) == s


def test_a_single_role_spec_has_no_roles_on_the_wire() -> None:
    s = JobSpec(entrypoint=["python", "train.py"], nproc_per_node=2, min_nodes=1, max_nodes=3)
    msg = spec_to_pb(s)
    assert len(msg.roles) == 0
    assert "roles" not in {f.name for f, _ in msg.ListFields()}
    back = spec_from_pb(msg)
    assert back == s and back.roles == ()


def test_wire_roles_are_bounded() -> None:
    msg = spec_to_pb(_spec())
    for i in range(40):
        msg.roles.add(name=f"r{i}", entrypoint=["x"], nproc_per_node=1, min_nodes=1, max_nodes=1)
    s = spec_from_pb(msg)
    assert len(s.roles) == MAX_ROLES + 1  # what was kept is enough to refuse it
    with pytest.raises(SpecError) as exc:
        s.validate()
    assert exc.value.field == "roles"


def test_shown_spec_withholds_role_secrets() -> None:
    role = dataclasses.replace(
        TRAINER, args=("--token", "s3cret", "--lr", "0.1"), env={"API_KEY": "s3cret"}
    )
    shown = _shown_spec_pb(_spec(PS, role))
    assert "s3cret" not in str(shown)
    assert list(shown.roles[1].env) == ["API_KEY"]
    assert "--lr" in shown.roles[1].args


# ---- rounds ---------------------------------------------------------------------------------


def _assignments(d: Driver, job_id: str) -> dict[str, Any]:
    return {n: d.assignment(n, job_id) for n, node in d.nodes.items() if job_id in node.assignments}


def _check_against_torch(d: Driver, job_id: str) -> None:
    got = sorted(_assignments(d, job_id).values(), key=lambda a: a.group_rank)
    assert [a.group_rank for a in got] == list(range(len(got)))
    groups = [(a.workers[0].role, len(a.workers)) for a in got]
    expected = torch_ranks(groups)
    for a, want in zip(got, expected, strict=True):
        assert len({w.role for w in a.workers}) == 1
        mine = [
            {
                "LOCAL_RANK": w.local_rank,
                "RANK": w.global_rank,
                "ROLE_RANK": w.role_rank,
                "WORLD_SIZE": w.world_size,
                "ROLE_WORLD_SIZE": w.role_world_size,
            }
            for w in a.workers
        ]
        assert mine == want


def test_round_waits_for_every_role_min_nodes() -> None:
    d = Driver()
    # Only the ps fits on one-slot nodes: two of them are no round (trainer needs 2 slots).
    # No node known could hold a trainer: the job waits for one because it asks to.
    d.connect("a", slots=1)
    d.connect("b", slots=1)
    d.submit("j", entrypoint=(), roles=(PS, TRAINER), last_call_timeout=0, wait_for_nodes=True)
    d.settle()
    assert not of_type(d.history, AssignRound)
    assert d.cluster.job_status("j").round == 0
    d.connect("c", slots=2)
    d.settle()
    assigned = _assignments(d, "j")
    assert {n: a.workers[0].role for n, a in assigned.items()} == {"a": "ps", "c": "trainer"}
    _check_against_torch(d, "j")
    members = {m.node: m.role for m in d.cluster.job_status("j").members}
    assert members == {"a": "ps", "c": "trainer"}


def test_nodes_too_small_for_a_role_let_the_join_timeout_run() -> None:
    # Two live one-slot nodes are enough nodes, but the trainer needs two slots: a job that asks
    # to wait for a bigger node must fail at its join timeout instead of waiting for busy nodes
    # that would never fit.
    d = Driver()
    d.connect("a", slots=1)
    d.connect("b", slots=1)
    d.submit(
        "j",
        entrypoint=(),
        roles=(PS, TRAINER),
        join_timeout=30,
        last_call_timeout=0,
        wait_for_nodes=True,
    )
    d.settle()
    for _ in range(4):
        d.advance(10)
        d.heartbeat_all()
        d.settle()
    assert d.state("j").value == "FAILED", d.reason("j")
    assert "rendezvous timed out" in d.reason("j")


def test_round_closes_at_once_when_every_role_is_at_max() -> None:
    d = Driver()
    for name in ("n1", "n2", "n3"):
        d.connect(name, slots=2)
    d.submit("j", entrypoint=(), roles=(PS, TRAINER), last_call_timeout=60)
    d.settle()
    assigned = _assignments(d, "j")
    assert sorted(a.workers[0].role for a in assigned.values()) == ["ps", "trainer", "trainer"]
    _check_against_torch(d, "j")
    assert {a.workers[0].world_size for a in assigned.values()} == {5}


def test_last_call_then_grows_a_role_toward_its_max() -> None:
    d = Driver()
    # n0 is live and could hold a trainer once its own job ends: the last call waits for it.
    d.connect("n0", slots=2)
    d.submit("other", min_nodes=1, max_nodes=1, nproc_per_node=2)
    d.settle()
    d.clear()
    d.connect("n1", slots=2)
    d.connect("n2", slots=2)
    d.submit("j", entrypoint=(), roles=(PS, TRAINER), last_call_timeout=10)
    d.settle()
    assert not of_type(d.history, AssignRound)  # 2 of max 3 nodes: last call
    d.advance(11)
    d.settle()
    assert len(_assignments(d, "j")) == 2
    # A node joins below the trainers' max_nodes: the round re-forms with 3 nodes.
    d.clear()
    d.connect("n3", slots=2)
    d.settle()
    assert len(of_type(d.history, StopRound)) == 2
    assigned = _assignments(d, "j")
    assert d.round("j") == 2 and len(assigned) == 3
    _check_against_torch(d, "j")
    # Every role at its max: a fourth node does not re-form the round.
    d.clear()
    d.connect("n4", slots=2)
    d.settle()
    assert not of_type(d.history, StopRound)


def test_big_groups_are_placed_first() -> None:
    # A 4-slot and a 1-slot node: the 2-slot trainer needs the big one even though the ps
    # role comes first in the spec and the big node first in group-rank order.
    d = Driver()
    d.connect("big", addr="10.0.0.1", slots=4)
    d.connect("small", addr="10.0.0.2", slots=1)
    d.submit("j", entrypoint=(), roles=(PS, TRAINER), last_call_timeout=0)
    d.settle()
    assigned = _assignments(d, "j")
    assert {n: a.workers[0].role for n, a in assigned.items()} == {"big": "trainer", "small": "ps"}
    # Group ranks follow node order, not role order: the trainer is group rank 0, RANK 0-1.
    assert assigned["big"].group_rank == 0
    assert [w.role_rank for w in assigned["small"].workers] == [0]
    _check_against_torch(d, "j")


def test_interleaved_roles_match_torch() -> None:
    roles = (
        Role("ps", ["x"], nproc_per_node=4, min_nodes=2, max_nodes=2),
        Role("trainer", ["y"], nproc_per_node=1, min_nodes=3, max_nodes=3),
        Role("eval", ["z"], nproc_per_node=3, min_nodes=1, max_nodes=1),
    )
    d = Driver()
    for i, slots in enumerate([1, 4, 3, 1, 4, 1]):
        d.connect(f"n{i}", addr=f"10.0.0.{i + 1}", slots=slots)
    d.submit("j", entrypoint=(), roles=roles, last_call_timeout=0)
    d.settle()
    assigned = _assignments(d, "j")
    assert (
        sorted(a.workers[0].role for a in assigned.values())
        == ["eval"] + ["ps"] * 2 + ["trainer"] * 3
    )
    # The roles interleave in group-rank order (n0 trainer, n1 ps, n2 eval, ...).
    order = [a.workers[0].role for a in sorted(assigned.values(), key=lambda a: a.group_rank)]
    assert order == ["trainer", "ps", "eval", "trainer", "ps", "trainer"]
    _check_against_torch(d, "j")


def test_a_failure_in_one_role_restarts_every_role() -> None:
    d = Driver()
    d.connect("n1", slots=2)
    d.connect("n2", slots=2)
    d.submit(
        "j",
        entrypoint=(),
        roles=(PS, dataclasses.replace(TRAINER, max_nodes=1)),
        max_restarts=1,
        last_call_timeout=0,
    )
    d.settle()
    ps = next(n for n, a in _assignments(d, "j").items() if a.workers[0].role == "ps")
    d.clear()
    d.exit(ps, 0, 1)
    d.settle()
    assert sorted(e.node for e in of_type(d.history, StopRound)) == ["n1", "n2"]
    assert d.attempt("j") == 1
    assert {a.attempt for a in _assignments(d, "j").values()} == {1}
    assert len(of_type(d.history, AssignRound)) == 2
    # The budget is the job's: a trainer failure now ends the job.
    trainer = next(n for n, a in _assignments(d, "j").items() if a.workers[0].role == "trainer")
    d.exit(trainer, 1, 3)
    d.settle()
    assert d.state("j").value == "FAILED"
    result = d.cluster.job_result("j")
    assert result is not None and result.root_cause is not None
    assert result.root_cause.role == "trainer"


# ---- the CLI --------------------------------------------------------------------------------


def test_cli_submit_roles_file(tmp_path: Any) -> None:
    from client.cli import CliError, _parser, build_spec

    path = tmp_path / "roles.json"
    path.write_text(
        json.dumps(
            [
                {"name": "ps", "entrypoint": ["python", "ps.py"]},
                {
                    "name": "trainer",
                    "entrypoint": ["python", "train.py"],
                    "args": ["--lr", "0.1"],
                    "nproc_per_node": 2,
                    "max_nodes": 2,
                },
            ]
        )
    )
    spec = build_spec(_parser().parse_args(["submit", "--roles", str(path), "--max-restarts", "3"]))
    spec.validate()
    assert spec.roles == (PS, TRAINER) and spec.max_restarts == 3
    for extra in (["--nnodes", "2"], ["--nproc-per-node", "2"], ["--", "python", "x.py"]):
        with pytest.raises(CliError):
            build_spec(_parser().parse_args(["submit", "--roles", str(path), *extra]))
    path.write_text('[{"name": "ps", "entrypoint": ["x"], "max_nodes": 0}]')
    with pytest.raises(SpecError) as exc:
        build_spec(_parser().parse_args(["submit", "--roles", str(path)])).validate()
    assert exc.value.field == "roles[0].max_nodes"
    path.write_text('[{"name": "ps", "entrypoint": ["x"], "max_node": 2}]')
    with pytest.raises(CliError, match=r"roles\[0\]\.max_node: unknown field"):
        build_spec(_parser().parse_args(["submit", "--roles", str(path)]))


# ---- the node's share -----------------------------------------------------------------------


def test_every_role_makes_the_same_store_choice() -> None:
    from nodeagent._launch import role_spec, uses_agent_store

    python_ps = Role("ps", ["python3", "ps.py"])
    binary_ps = Role("ps", ["./ps_server"])
    both_python = JobSpec(roles=(python_ps, TRAINER))
    assert [uses_agent_store(role_spec(both_python, r)) for r in ("ps", "trainer")] == [True] * 2
    # One role is a binary: its workers host the store at RANK 0, so the trainers must not
    # wait for an agent store that group rank 0 (maybe the binary's node) never serves.
    mixed = JobSpec(roles=(binary_ps, TRAINER))
    assert [uses_agent_store(role_spec(mixed, r)) for r in ("ps", "trainer")] == [False] * 2
    opted_out = JobSpec(
        roles=(python_ps, dataclasses.replace(TRAINER, env={"TORCHELASTIC_USE_AGENT_STORE": "0"}))
    )
    assert [uses_agent_store(role_spec(opted_out, r)) for r in ("ps", "trainer")] == [False] * 2
    single = JobSpec(entrypoint=["python", "train.py"])
    assert role_spec(single, "default") is single


_OK = {"nproc_per_node": 1, "min_nodes": 1, "max_nodes": 1}


@pytest.mark.parametrize(
    "role",
    [
        pb.Role(),
        pb.Role(name="t", entrypoint=["x"], nproc_per_node=-1, min_nodes=1, max_nodes=1),
        pb.Role(name="t", entrypoint=["x"], nproc_per_node=1, min_nodes=-5, max_nodes=2**31 - 1),
        pb.Role(name="ps\x00", entrypoint=["x"], **_OK),
        pb.Role(name="t", entrypoint=["x" * 70_000], **_OK),
        pb.Role(name="t", entrypoint=["x"], env={"": "v"}, **_OK),
        pb.Role(name="ps", entrypoint=["x"], **_OK),  # a second "ps"
    ],
)
def test_hostile_wire_roles_are_spec_errors(role: pb.Role) -> None:
    msg = spec_to_pb(_spec())
    msg.roles.append(role)
    with pytest.raises(SpecError) as exc:
        spec_from_pb(msg).validate()
    assert exc.value.field.startswith("roles[2]"), exc.value
