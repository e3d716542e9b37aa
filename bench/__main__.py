"""`python -m bench [SCENARIO ...] [--runs N] [--quick] [--json PATH]`: run the benchmarks.

Without a scenario every one runs. Prints a table (scenario, metric, system, median, min, max,
n) and the torchrun/gelastic ratios on stdout, progress on stderr, and writes the JSON; the
scale scenarios' charts go next to it as PNG when matplotlib is installed.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

from bench._common import TORCHRUN, Measurement, log, render_table, write_json
from bench._plots import write_plots

SCENARIOS = (
    "cold_start",
    "recovery_worker_crash",
    "recovery_agent_kill",
    "failure_report",
    "rendezvous_scale",
    "heartbeat_capacity",
    "footprint",
    "coordinator_restart",
    "submit_throughput",
)
DEFAULT_RUNS = 5
DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "results.json"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument(
        "scenarios",
        nargs="*",
        metavar="SCENARIO",
        help=f"any of {', '.join(SCENARIOS)} (default: all)",
    )
    parser.add_argument(
        "--runs", type=int, default=None, help=f"runs per scenario (default {DEFAULT_RUNS})"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="each scenario once at its smallest size (a smoke test)",
    )
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help=f"default {DEFAULT_JSON}")
    args = parser.parse_args(argv)
    unknown = [s for s in args.scenarios if s not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenario {unknown[0]!r}; choose from {', '.join(SCENARIOS)}")
    runs = args.runs if args.runs is not None else (1 if args.quick else DEFAULT_RUNS)
    if runs < 1:
        parser.error(f"--runs must be at least 1, got {runs}")
    chosen = args.scenarios or list(SCENARIOS)
    if not Path(TORCHRUN).exists():
        parser.error(f"torchrun not found at {TORCHRUN}; install gelastic with its torch extra")

    measurements: list[Measurement] = []
    failed: list[str] = []
    t0 = time.monotonic()
    for name in chosen:
        module = importlib.import_module(f"bench.{name}")
        log(f"{name}: {runs} run(s){' (quick)' if args.quick else ''} ...")
        t = time.monotonic()
        try:
            measurements += module.run(runs, args.quick)
        except Exception as exc:  # one broken scenario must not hide the others' numbers
            log(f"{name} FAILED: {type(exc).__name__}: {exc}")
            failed.append(name)
        log(f"{name}: done in {time.monotonic() - t:.1f} s")

    meta = {
        "runs": runs,
        "quick": args.quick,
        "scenarios": chosen,
        "failed": failed,
        "elapsed_s": round(time.monotonic() - t0, 1),
    }
    write_json(args.json, measurements, meta)
    print(render_table(measurements))
    log(f"wrote {args.json}")
    write_plots(measurements, args.json.parent)
    if failed:
        log(f"failed scenarios: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
