"""The Python blocks of README.md and docs/*.md run, as a reader would run them, against one
real LocalCluster; and `gelastic logs --json` prints what the troubleshooting page says.

How a block runs (README.md, "Development"): the docs' example coordinator address
(`10.0.0.1:29400`, or `host:port`) is replaced with the cluster's, `$GELASTIC_COORDINATOR` and
`$GELASTIC_TOKEN_FILE` point at it, and the names `addr` (the address), `spec` (a small command
job of 2 ranks), `job_id` and `key` (a finished function job's id and result key) are defined.
A block preceded by `<!-- docs-test: skip (REASON) -->` is not run; every other block must run
without raising.
"""

from __future__ import annotations

import io
import json
import sys
from collections.abc import Iterator
from contextlib import redirect_stdout
from typing import Any

import pytest

from client import JobSpec, WorkerState
from client.cli import main as gelastic_main
from gelastic.local import LocalCluster
from tests._docs import all_blocks
from tests.e2e.conftest import assert_no_leftovers

TIMEOUT = 120
PLACEHOLDERS = ("10.0.0.1:29400", "host:port")
"""The coordinator addresses the docs use; the test runs each block against its own."""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster(nodes=1, slots=2, workdir=tmp_path_factory.mktemp("docs-cluster"))
    with c:
        yield c
    assert_no_leftovers(c)


@pytest.fixture
def env(cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch) -> LocalCluster:
    for name, value in cluster.client_env.items():
        monkeypatch.setenv(name, value)
    return cluster


def _function_job(cluster: LocalCluster) -> tuple[str, bytes]:
    job = cluster.client.submit(JobSpec(entrypoint="operator:add", args=(2, 3)))
    result = job.wait(TIMEOUT)
    assert result.state is WorkerState.SUCCEEDED and result.return_values == {0: 5}
    return job.job_id, job._result_key


def test_the_python_blocks_of_the_docs_run(env: LocalCluster, capsys: Any) -> None:
    job_id, key = _function_job(env)
    spec = JobSpec(
        entrypoint=[sys.executable, "-c", "print('hello')"], nproc_per_node=2, name="docs"
    )
    ran: list[str] = []
    skipped: list[str] = []
    failed: list[str] = []
    for block in all_blocks():
        if block.lang != "python":
            continue
        if block.skip is not None:
            skipped.append(f"{block.where} ({block.skip})")
            continue
        code = block.text
        for placeholder in PLACEHOLDERS:
            code = code.replace(placeholder, env.address)
        namespace: dict[str, Any] = {
            "__name__": "docs_block",
            "addr": env.address,
            "spec": spec,
            "job_id": job_id,
            "key": key,
        }
        try:
            exec(compile(code, block.where, "exec"), namespace)
        except Exception as exc:
            failed.append(f"{block.where}: {type(exc).__name__}: {exc}")
        else:
            ran.append(block.where)
    with capsys.disabled():
        print(f"\ndocs blocks: {len(ran)} ran, {len(skipped)} skipped")
        for where in skipped:
            print(f"  skipped {where}")
    assert not failed, "blocks without a skip marker failed:\n" + "\n".join(failed)
    assert len(ran) >= 4, ran


def test_logs_json_prints_one_object_per_line(env: LocalCluster) -> None:
    code = (
        "import sys; print('first'); print('second \\x1b[2J', flush=True); sys.stdout.write('tail')"
    )
    job = env.client.submit(JobSpec(entrypoint=[sys.executable, "-c", code]))
    assert job.wait(TIMEOUT).state is WorkerState.SUCCEEDED
    buffer = io.BytesIO()
    out = io.TextIOWrapper(buffer, encoding="utf-8")
    with redirect_stdout(out):
        assert gelastic_main(["logs", job.job_id, "--rank", "0", "--json"]) == 0
    out.flush()
    lines = [json.loads(line) for line in buffer.getvalue().decode().splitlines()]
    head = {"job": job.job_id, "rank": 0, "stream": "stdout"}
    assert lines == [
        {**head, "line": "first"},
        {**head, "line": "second \x1b[2J"},
        {**head, "line": "tail"},
    ]
