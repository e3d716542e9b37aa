"""A function defined in the launching script's own `__main__`, launched the way torchelastic's
example does (`elastic_launch(config, entrypoint=trainer)(args)`): the workers run the script as
`__mp_main__`, never its `if __name__ == "__main__":` block, and call the function."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
import json
import os
import sys

from client import JobSpec
from gelastic.local import LocalCluster

MARKER_DIR = os.environ["MARKER_DIR"]
# Top level: runs in the launcher and once in every worker (as __mp_main__).
with open(os.path.join(MARKER_DIR, f"top.{os.getpid()}"), "w") as f:
    f.write(__name__)


class Point:
    def __init__(self, x, y):
        self.x, self.y = x, y


def trainer(x, point=None):
    return {
        "x": x,
        "rank": int(os.environ["RANK"]),
        "name": __name__,
        "point": None if point is None else [type(point).__name__, point.x, point.y],
        "main_is_script": getattr(sys.modules["__main__"], "trainer", None) is not None,
        "pid": os.getpid(),
    }


def make_point(x):
    return Point(x, -x)


if __name__ == "__main__":
    with open(os.path.join(MARKER_DIR, "main_block"), "a") as f:
        f.write(f"{os.getpid()}\\n")
    with LocalCluster(nodes=1, slots=2, workdir=os.environ["CLUSTER_DIR"]) as c:
        r1 = c.client.submit(
            JobSpec(entrypoint=trainer, args=(3,), kwargs={"point": Point(1, 2)},
                    nproc_per_node=2)
        ).wait(60)
        # A Point is no JSON: it comes back as a pickle, loaded only when asked. Every node
        # here is this script's own child (a private LocalCluster), so trusting it is sound.
        r2 = c.client.submit(JobSpec(entrypoint=make_point, args=(5,))).wait(
            60, trust_pickles=True
        )
    assert not r1.is_failed(), r1.format_failures()
    assert not r2.is_failed(), r2.format_failures()
    p = r2.return_values[0]
    print(json.dumps({
        "values": r1.return_values,
        "point": [type(p).__name__, type(p) is Point, p.x, p.y],
        "pid": os.getpid(),
    }))
"""


def test_a_function_of_the_launching_scripts_main_runs_without_its_main_block(
    tmp_path: Path,
) -> None:
    path = tmp_path / "launch_trainer.py"
    path.write_text(SCRIPT)
    markers = tmp_path / "markers"
    markers.mkdir()
    env = dict(os.environ)
    env.update(
        PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        MARKER_DIR=str(markers),
        CLUSTER_DIR=str(tmp_path / "cluster"),
    )
    proc = subprocess.run(
        [sys.executable, str(path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    # The __main__ block ran once: in the launcher, never in a worker.
    assert (markers / "main_block").read_text().split() == [str(out["pid"])]
    values = {int(k): v for k, v in out["values"].items()}
    assert sorted(values) == [0, 1]
    for rank, v in values.items():
        assert v["x"] == 3 and v["rank"] == rank
        assert v["name"] == "__mp_main__"
        # A pickled arg of a class of the script's __main__ was rebuilt in the worker.
        assert v["point"] == ["Point", 1, 2]
        assert v["main_is_script"]
        assert v["pid"] != out["pid"]
    # A return value of a class of the script's __main__ comes back as the launcher's own class.
    assert out["point"] == ["Point", True, 5, -5]
    # The top level ran in the launcher (as __main__) and in each of the 3 workers.
    tops = sorted(p.read_text() for p in markers.glob("top.*"))
    assert tops == ["__main__", "__mp_main__", "__mp_main__", "__mp_main__"]
