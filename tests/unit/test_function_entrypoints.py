"""Function entrypoints: what a worker can import by name is accepted (a function of the
launching script's `__main__` included, with the script's path), what it cannot is refused at
`JobSpec(...)` with a SpecError that names the function and says what to do."""

from __future__ import annotations

import functools
import math
import os
import subprocess
import sys
import threading
import types
from pathlib import Path
from typing import Any

import pytest

from client.assignment import RoundAssignment, WorkerRanks
from client.model import MAX_FUNCTION_ARGS_BYTES, JobSpec, SpecError, function_reference
from client.wire import spec_from_pb, spec_to_pb
from nodeagent._launch import build_launch_plan, check_main_script
from protos.gelastic.v1 import gelastic_pb2 as pb

REPO = Path(__file__).resolve().parents[2]
HOW = "define it at the top level of an importable module or of the script you run"


def top_level(x: int) -> int:
    return x


class Holder:
    def __init__(self, value: Any) -> None:
        self.value = value

    def method(self, x: int) -> Any:
        return (self.value, x)

    @classmethod
    def build(cls, x: int) -> Holder:
        return cls(x)

    @staticmethod
    def static(x: int) -> int:
        return x


def _not_wrapping(fn: Any) -> Any:
    def other(*a: Any) -> Any:
        return fn(*a)

    return other


@_not_wrapping
def shadowed(x: int) -> int:  # the name now holds another function than the one defined
    return x


def _wrapping(fn: Any) -> Any:
    @functools.wraps(fn)
    def wrapper(*a: Any) -> Any:
        return fn(*a)

    return wrapper


@_wrapping
def wrapped(x: int) -> int:  # like torch's @record: the name holds the wrapper, which says so
    return x


class CallMe:
    def __call__(self, x: int) -> int:
        return x


def refused(entrypoint: Any, **kw: Any) -> SpecError:
    with pytest.raises(SpecError) as info:
        JobSpec(entrypoint=entrypoint, **kw)
    return info.value


# -- refusals ----------------------------------------------------------------------------------


def test_a_lambda_is_refused_naming_it() -> None:
    e = refused(lambda x: x)
    assert e.field == "entrypoint"
    assert "<lambda>" in str(e) and "is a lambda" in str(e) and HOW in str(e)
    assert __name__ in str(e)


def test_a_nested_function_and_a_closure_are_refused() -> None:
    def nested(x: int) -> int:
        return x

    y = 3

    def closure(x: int) -> int:
        return x + y

    for fn in (nested, closure):
        e = refused(fn)
        assert e.field == "entrypoint"
        assert f"{fn.__qualname__}" in str(e) and "inside another function" in str(e)
        assert HOW in str(e)


def test_a_method_bound_to_an_unpicklable_object_is_refused() -> None:
    e = refused(Holder(threading.Lock()).method)
    assert e.field == "entrypoint"
    assert "Holder.method" in str(e) and "cannot be pickled" in str(e) and HOW in str(e)


@pytest.mark.parametrize("fn", [len, math.sqrt, [].append, os.getcwd])
def test_a_builtin_is_refused(fn: Any) -> None:
    e = refused(fn)
    assert e.field == "entrypoint"
    assert "builtin" in str(e) and HOW in str(e)


def test_a_function_of_an_interactive_session_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    session = types.ModuleType("__main__")  # a REPL's __main__: no __file__
    exec("def train(x):\n    return x\n", session.__dict__)
    monkeypatch.setitem(sys.modules, "__main__", session)
    e = refused(session.train)
    assert e.field == "entrypoint"
    assert "__main__:train" in str(e) and "interactive session" in str(e) and HOW in str(e)


def test_a_function_of_python_dash_c_is_refused_before_anything_is_sent() -> None:
    code = (
        "from client.model import JobSpec, SpecError\n"
        "def train(x):\n    return x\n"
        "try:\n    JobSpec(entrypoint=train)\n"
        "except SpecError as e:\n    print(e.field, e)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("entrypoint entrypoint: __main__:train is defined in an")
    assert "interactive session" in proc.stdout


def test_an_unpicklable_positional_argument_is_named() -> None:
    e = refused(top_level, args=(1, threading.Lock()))
    assert e.field == "args"
    assert "args[1]" in str(e) and f"{__name__}:top_level" in str(e)
    assert "cannot be pickled" in str(e)


def test_an_unpicklable_keyword_argument_is_named() -> None:
    e = refused(top_level, args=(1,), kwargs={"ok": 2, "bad": lambda: 0})
    assert e.field == "kwargs"
    assert "kwargs['bad']" in str(e) and "cannot be pickled" in str(e)


def test_a_reference_string_with_unpicklable_args_is_refused_too() -> None:
    e = refused("pkg.mod:fn", args=(threading.Lock(),))
    assert e.field == "args" and "args[0]" in str(e) and "pkg.mod:fn" in str(e)


def test_oversized_arguments_are_refused_without_pickling_them_whole() -> None:
    big = b"x" * (MAX_FUNCTION_ARGS_BYTES // 2 + 16)
    e = refused(top_level, args=(big, big))
    assert e.field == "args" and "over the limit" in str(e) and "args[1]" in str(e)


def test_a_name_that_holds_another_object_is_refused() -> None:
    e = refused(_unwrapped_shadowed())
    assert e.field == "entrypoint" and "another object" in str(e)


def _unwrapped_shadowed() -> Any:
    # The function `shadowed` was defined as before the decorator replaced it.
    inner = shadowed.__closure__[0].cell_contents
    assert inner.__qualname__ == "shadowed"
    return inner


def test_objects_without_a_qualname_are_refused() -> None:
    for fn in (functools.partial(top_level, 1), CallMe()):
        e = refused(fn)
        assert e.field == "entrypoint"


# -- accepted ----------------------------------------------------------------------------------


def test_importable_callables_are_referenced_by_module_and_qualname() -> None:
    assert function_reference(top_level) == f"{__name__}:top_level"
    assert function_reference(wrapped) == f"{__name__}:wrapped"
    assert function_reference(CallMe) == f"{__name__}:CallMe"  # a class is called to make one
    assert function_reference(Holder.static) == f"{__name__}:Holder.static"
    assert function_reference(Holder.build) == f"{__name__}:Holder.build"
    spec = JobSpec(entrypoint=top_level, args=(1,))
    assert spec.function == f"{__name__}:top_level" and spec.main_path == ""
    spec.validate()


def test_a_method_bound_to_a_picklable_object_runs_with_it_as_first_argument() -> None:
    obj = Holder(7)
    spec = JobSpec(entrypoint=obj.method, args=(1,))
    assert spec.function == f"{__name__}:Holder.method"
    assert len(spec.args) == 2 and isinstance(spec.args[0], Holder) and spec.args[1] == 1
    spec.validate()
    assert JobSpec(entrypoint=Holder.build, args=(1,)).args == (1,)  # a classmethod: as is


def _fake_main(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> types.ModuleType:
    script = tmp_path / "launch.py"
    script.write_text("def train(x):\n    return x\n")
    main = types.ModuleType("__main__")
    main.__file__ = os.path.relpath(script)
    exec(compile(script.read_text(), str(script), "exec"), main.__dict__)
    monkeypatch.setitem(sys.modules, "__main__", main)
    monkeypatch.delitem(sys.modules, "__mp_main__", raising=False)
    return main


def test_a_function_of_the_main_script_records_the_scripts_absolute_path(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    main = _fake_main(monkeypatch, tmp_path)
    spec = JobSpec(entrypoint=main.train, args=(3,), nproc_per_node=2)
    assert spec.function == "__main__:train"
    assert spec.main_path == str(tmp_path / "launch.py")
    spec.validate()
    # Return values the workers pickle as __mp_main__.<class> resolve to this very script.
    assert sys.modules["__mp_main__"] is main
    # The path crosses the wire both ways.
    back = spec_from_pb(spec_to_pb(spec))
    assert back.function == "__main__:train" and back.main_path == spec.main_path
    back.validate()


def test_the_workers_are_told_the_main_script(tmp_path: Path) -> None:
    script = tmp_path / "launch.py"
    script.write_text("def train(x):\n    return x\n")
    spec = JobSpec(entrypoint="__main__:train", main_path=str(script), nproc_per_node=1)
    a = RoundAssignment(
        job_id="job1",
        round=0,
        attempt=0,
        spec=spec,
        group_rank=0,
        group_world_size=1,
        master_addr="127.0.0.1",
        master_port=29500,
        workers=(WorkerRanks(0, 0, 0, 1, 1),),
        run_id="run1",
    )
    (launch,) = build_launch_plan(a, log_root=tmp_path / "logs", node_name="n0", agent_env={})
    argv = list(launch.argv)
    assert argv[argv.index("--function") + 1] == "__main__:train"
    assert argv[argv.index("--main-path") + 1] == str(script)
    assert argv.index("--main-path") < argv.index("--")


# -- main_path bounds --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("function", "main_path", "field", "needle"),
    [
        ("__main__:train", "", "entrypoint", "function of a main script"),
        ("pkg.mod:train", "/x/launch.py", "main_path", "only for a function of the main script"),
        ("__main__:train", "/x/la\x00unch.py", "main_path", "invalid path"),
        ("__main__:train", "/" + "x" * 5000 + ".py", "main_path", "invalid path"),
        ("__main__:train", "/x/launch.sh", "main_path", "must name a .py file"),
    ],
)
def test_main_path_is_bounded(function: str, main_path: str, field: str, needle: str) -> None:
    spec = JobSpec(entrypoint=function, main_path=main_path)
    with pytest.raises(SpecError) as info:
        spec.validate()
    assert info.value.field == field and needle in str(info.value)


def test_a_command_cannot_carry_a_main_path() -> None:
    with pytest.raises(SpecError) as info:
        JobSpec(entrypoint=["python", "x.py"], main_path="/x/launch.py").validate()
    assert info.value.field == "main_path"


def test_the_agent_refuses_a_main_path_that_is_not_a_regular_py_file(tmp_path: Path) -> None:
    (tmp_path / "ok.py").write_text("")
    (tmp_path / "dir.py").mkdir()
    check_main_script("ok.py", str(tmp_path))  # relative to the job's cwd
    check_main_script(str(tmp_path / "ok.py"), "/")
    for bad, needle in (
        ("missing.py", "cannot be used on this node"),
        ("dir.py", "not a regular file"),
        ("ok.sh", "not a .py file"),
    ):
        with pytest.raises(ValueError, match=needle) as info:
            check_main_script(bad, str(tmp_path))
        assert bad in str(info.value)


def test_the_coordinator_refuses_a_bad_main_path_from_the_wire() -> None:
    msg = pb.JobSpec(function="__main__:train", main_path="/x/\x00.py")
    with pytest.raises(SpecError) as info:
        spec_from_pb(msg).validate()  # what Submit runs before storing anything
    assert info.value.field == "main_path"
