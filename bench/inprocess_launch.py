"""inprocess_launch: torchelastic's `elastic_launch(config, fn)(x)` against `gelastic.launch`.

The same call a test or a notebook makes, on both: a `LaunchConfig(min_nodes=1, max_nodes=1,
nproc_per_node=2, max_restarts=0)` and a trivial function (`value` below), from the call to its
`{rank: value}` (`call -> results`); then a function that raises on rank 1, from the call to the
`ChildFailedError` (`call -> ChildFailedError`). Each call runs in a fresh interpreter that has
imported both launchers already, so that the row is the launch alone (torch's c10d rendezvous and
its agent; gelastic's embedded coordinator and agent) and not the import of torch; the peak RSS of
that interpreter, children excluded, is reported too (`caller peak RSS`, MB).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from bench._common import GELASTIC, PY, TORCH, Measurement, log

SCENARIO = "inprocess_launch"
TIMEOUT = 180.0
NPROC = 2
ROOT = Path(__file__).resolve().parents[1]

_CALLER = """
import json, resource, sys, time, uuid
from torch.distributed.launcher.api import LaunchConfig, elastic_launch
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from gelastic.launch import launch
from bench.inprocess_launch import value, fail_on_rank_1

which, nproc = sys.argv[1], int(sys.argv[2])
config = LaunchConfig(
    min_nodes=1, max_nodes=1, nproc_per_node=nproc, max_restarts=0,
    rdzv_backend="c10d", rdzv_endpoint="localhost:0", run_id=uuid.uuid4().hex[:12],
)
launcher = elastic_launch if which == "torchrun" else launch
t0 = time.monotonic()
ok = launcher(config, value)(21)
ok_s = time.monotonic() - t0
assert ok == {r: 42 for r in range(nproc)}, ok
t0 = time.monotonic()
try:
    launcher(config, fail_on_rank_1)()
except ChildFailedError as e:
    assert e.get_first_failure()[0] == 1
    fail_s = time.monotonic() - t0
else:
    raise AssertionError("no ChildFailedError")
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"ok": ok_s, "fail": fail_s, "rss_mib": rss}))
"""


def value(x: int) -> int:
    """What each rank returns: JSON on gelastic's side, a pickle on torch's."""
    return 2 * x


def fail_on_rank_1() -> None:
    if int(os.environ["RANK"]) == 1:
        raise ValueError("rank 1 fails")


def _one(system: str) -> dict[str, float] | None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    try:
        proc = subprocess.run(
            [PY, "-c", _CALLER, system, str(NPROC)],
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
            cwd=ROOT,
            env=env,
        )
    except subprocess.TimeoutExpired:
        return None
    if proc.returncode != 0:
        log(f"  {SCENARIO} {system}: exit {proc.returncode}: {proc.stderr[-2000:]}")
        return None
    last = proc.stdout.strip().splitlines()[-1]
    data = json.loads(last)
    return {k: float(v) for k, v in data.items()}


def run(runs: int, quick: bool) -> list[Measurement]:
    out: list[Measurement] = []
    rows = {
        system: (
            Measurement(SCENARIO, f"call -> results ({NPROC} workers)", system),
            Measurement(SCENARIO, "call -> ChildFailedError", system),
            Measurement(SCENARIO, "caller peak RSS (MB)", system),
        )
        for system in (TORCH, GELASTIC)
    }
    n = 1 if quick else runs
    for i in range(n):
        for system, (ok, fail, rss) in rows.items():
            got = _one(system)
            ok.add(None if got is None else got["ok"])
            fail.add(None if got is None else got["fail"])
            rss.add(None if got is None else got["rss_mib"])
            log(f"  {SCENARIO} run {i + 1}/{n} {system}: {got}")
    for ms in rows.values():
        out.extend(ms)
    return out
