"""`gelastic.launch`: torch's LaunchConfig fields become the one-host job they mean here.

Pure: the spec is built and checked, nothing starts (tests/e2e/test_inprocess_launch.py runs
it, beside torch's own launcher).
"""

from __future__ import annotations

import dataclasses
import sys

import pytest

from gelastic.launch import LaunchConfig, LaunchError, entrypoint_name, launch_spec
from tests.workloads import launched


def config(**kw: object) -> LaunchConfig:
    base: dict[str, object] = {"min_nodes": 1, "max_nodes": 1, "nproc_per_node": 2}
    base.update(kw)
    return LaunchConfig(**base)  # type: ignore[arg-type]


def test_our_launch_config_has_torchs_fields_and_defaults() -> None:
    api = pytest.importorskip("torch.distributed.launcher.api")
    theirs = {f.name: f for f in dataclasses.fields(api.LaunchConfig)}
    ours = {f.name: f for f in dataclasses.fields(LaunchConfig)}
    assert list(ours) == list(theirs)
    for name, f in theirs.items():
        if f.default is not dataclasses.MISSING:
            assert ours[name].default == f.default, name
    t, o = api.LaunchConfig(1, 1, 2), LaunchConfig(1, 1, 2)
    assert (o.rdzv_configs, o.shutdown_timeout) == (t.rdzv_configs, t.shutdown_timeout)


def test_the_fields_map_onto_the_job() -> None:
    spec = launch_spec(
        config(max_restarts=1, run_id="run-1", role="trainer", rdzv_configs={"timeout": 60}),
        launched.rank_and_value,
        (3,),
    )
    assert (spec.nproc_per_node, spec.min_nodes, spec.max_nodes, spec.max_restarts) == (2, 1, 1, 1)
    assert (spec.name, spec.role, spec.join_timeout) == ("run-1", "trainer", 60.0)
    assert spec.function == "tests.workloads.launched:rank_and_value"
    assert spec.stop_grace == 30.0
    assert launch_spec(config(rdzv_timeout=5), launched.rank_and_value, ()).join_timeout == 5.0
    c10d = config(rdzv_configs={"join_timeout": 7, "timeout": 5})
    assert launch_spec(c10d, launched.rank_and_value, ()).join_timeout == 7.0
    assert launch_spec(config(shutdown_timeout=2), launched.rank_and_value, ()).stop_grace == 2.0
    assert launch_spec(config(), launched.rank_and_value, ()).name.startswith("launch-")


def test_a_program_entrypoint_and_the_static_endpoint() -> None:
    spec = launch_spec(
        config(rdzv_backend="static", rdzv_endpoint="127.0.0.1:29555"), sys.executable, ("-c", 1)
    )
    assert list(spec.argv) == [sys.executable, "-c", "1"]
    assert (spec.master_addr, spec.master_port) == ("127.0.0.1", 29555)
    assert launch_spec(config(local_addr="test_host"), "true", ()).master_addr == "test_host"


@pytest.mark.parametrize(
    ("kw", "words"),
    [
        ({"min_nodes": 2, "max_nodes": 2}, "min_nodes must be 1"),
        ({"max_nodes": 0}, "max_nodes must be an int >= min_nodes"),
        ({"virtual_local_rank": True}, "virtual_local_rank is not supported"),
        ({"rdzv_backend": "zk"}, "rdzv_backend 'zk'"),
        ({"run_id": "a b"}, "run_id must be a name"),
        ({"run_id": "x" * 129}, "run_id must be a name"),
        ({"rdzv_configs": {"timeout": "soon"}}, "rdzv_configs['timeout']"),
        ({"rdzv_configs": {"timeout": 0}}, "must be over 0"),
        ({"rdzv_backend": "static", "rdzv_endpoint": "host"}, "rdzv_endpoint must be host:port"),
        ({"rdzv_backend": "static", "rdzv_endpoint": "a b:1"}, "not a host name"),
        ({"local_addr": "-x"}, "local_addr"),
    ],
)
def test_a_config_this_launcher_cannot_honour_names_the_field(
    kw: dict[str, object], words: str
) -> None:
    with pytest.raises(LaunchError) as e:
        launch_spec(config(**kw), launched.rank_and_value, ())
    assert words in str(e.value)


def test_entrypoint_name_is_torchs() -> None:
    assert entrypoint_name(launched.fail_on_rank, ()) == "fail_on_rank"
    assert entrypoint_name(sys.executable, ("-u", "train.py", "--lr")) == "train.py"
    assert entrypoint_name("/bin/echo", ("hi",)) == "/bin/echo"
