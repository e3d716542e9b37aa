"""A worker never finds the agent's token, or the path of its file, in its environment.

Workers start from the agent's environment. Before the fix an agent started with its token
named in its environment (`GELASTIC_TOKEN_FILE`, as the client reads it, or the value itself
in some variable) handed it to every job, which could print it into its logs or `cat` the file.
Now the agent drops from its environment, once it has read its token, every variable that names
a token or holds the token's value or its file's path. End to end: real coordinator, a real
agent started with the token by file and in its environment, a real command job printing its env.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from client import JobSpec, WorkerState
from gelastic.local import LocalCluster
from nodeagent._launch import without_agent_secrets
from tests.e2e.conftest import PY, assert_no_leftovers

TIMEOUT = 120
PRINT_ENV = (
    "import json, os, sys\n"
    "env = dict(os.environ)\n"
    "open(os.path.join(os.environ['OUT_DIR'], 'env.json'), 'w').write(json.dumps(env))\n"
    "print(json.dumps(env))\n"
)


def test_without_agent_secrets_drops_names_values_and_paths() -> None:
    env = {
        "PATH": "/usr/bin",
        "GELASTIC_TOKEN_FILE": "/anything",
        "GELASTIC_AGENT_TOKEN": "x",
        "COPY": "Bearer s3cret-s3cret-s3cret",
        "WHERE": "--token-file=/etc/gelastic/agent.token",
        "HOME": "/root",
    }
    kept = without_agent_secrets(env, ["s3cret-s3cret-s3cret", "/etc/gelastic/agent.token", ""])
    assert kept == {"PATH": "/usr/bin", "HOME": "/root"}


def test_a_worker_sees_neither_the_token_nor_its_file(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    # The cluster hands its coordinator and agent a token file of its own; the agent's
    # environment names that file too (as a user's client finds it) and holds copies of the
    # token itself.
    cluster = LocalCluster(nodes=1, slots=1, workdir=tmp_path / "cluster")
    token_file = Path(cluster.token_file)
    token = token_file.read_text().strip()
    assert len(token) >= 32
    cluster.env.update(
        {
            "GELASTIC_TOKEN_FILE": str(token_file),
            "GELASTIC_AGENT_TOKEN": token,
            "SOME_COPY_OF_IT": f"token={token}",
        }
    )
    with cluster:
        job = cluster.client.submit(
            JobSpec(entrypoint=[PY, "-c", PRINT_ENV], env={"OUT_DIR": str(out)})
        )
        result = job.wait(TIMEOUT)
        assert result.state == WorkerState.SUCCEEDED, result.format_failures()
    assert_no_leftovers(cluster)
    env = json.loads((out / "env.json").read_text())
    assert env["OUT_DIR"] == str(out)  # it is the worker's env, with the job's own variables
    text = json.dumps(env)
    assert token not in text
    assert str(token_file) not in text and os.path.realpath(token_file) not in text
    assert not {"GELASTIC_TOKEN_FILE", "GELASTIC_AGENT_TOKEN", "SOME_COPY_OF_IT"} & set(env)
    # Nor in what the worker printed, as kept in its log on the agent's host.
    logs = [p.read_text() for p in cluster.agent_log_dir("node-0").rglob("stdout.log")]
    assert logs and all(token not in log and str(token_file) not in log for log in logs)
