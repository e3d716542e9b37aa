"""Every pattern that validates input matches the whole value: a trailing newline is refused.

Before the fix the patterns ended in `$` and were used with `match()`, which also accepts a
string that ends in "\\n": a job named "x\\n" was accepted, its id "x\\n-..." was then refused by
GetJob/CancelJob/WatchJob, and the agent dropped its Assign, so the job held its slots for good.
"""

from __future__ import annotations

import pytest

from client.model import JobSpec, SpecError, is_function_reference, is_job_id, is_name
from nodeagent._launch import uses_agent_store

HOSTILE_SUFFIXES = ("\n", "\n\n")


@pytest.mark.parametrize("suffix", HOSTILE_SUFFIXES)
def test_names_and_job_ids_with_a_trailing_newline_are_refused(suffix: str) -> None:
    assert is_name("x") and is_job_id("x-1") and is_function_reference("m:f")
    assert not is_name("x" + suffix)
    assert not is_job_id("x-1" + suffix)
    assert not is_function_reference("m:f" + suffix)


@pytest.mark.parametrize(
    ("field", "spec"),
    [
        ("name", JobSpec(entrypoint=["true"], name="x\n")),
        ("role", JobSpec(entrypoint=["true"], role="trainer\n")),
        ("env", JobSpec(entrypoint=["true"], env={"A\n": "1"})),
        ("entrypoint", JobSpec(entrypoint=(), function="m:f\n")),
    ],
)
def test_a_spec_whose_field_ends_in_a_newline_names_the_field(field: str, spec: JobSpec) -> None:
    with pytest.raises(SpecError) as err:
        spec.validate()
    assert err.value.field == field


def test_a_function_reference_with_a_newline_is_not_taken_for_a_function() -> None:
    spec = JobSpec(entrypoint="m:f\n")
    assert not spec.is_function


def test_a_program_named_python_with_a_newline_is_not_taken_for_python() -> None:
    assert uses_agent_store(JobSpec(entrypoint=["python3", "train.py"]))
    assert not uses_agent_store(JobSpec(entrypoint=["python3\n", "train.py"]))
