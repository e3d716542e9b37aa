"""`python -m bench [SCENARIO ...] [--runs N] [--quick] [--json PATH]`: run the benchmarks.

Without a scenario every one runs but `soak`, which runs only when named: it lasts `--minutes`
(`python -m bench soak --minutes 60 --coordinator-arg=--retain-jobs=500`), and its rows of RSS,
database size and Submit p99 over time go into the JSON's `meta.soak` and `soak.png`; the torch
scenarios (`multinode`: three torchrun or `gelastic run` launchers as one job, among them) and
`failover` (three coordinator replicas on etcd) run only when named too. Prints a table (scenario, metric, system, median, min, max,
n) and the torchrun/gelastic ratios on stdout, progress on stderr, and writes the JSON; the
scale scenarios' charts go next to it as PNG when matplotlib is installed.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

from bench import soak
from bench._common import TORCHRUN, Measurement, log, render_table, write_json
from bench._plots import write_plots, write_soak_plot

TORCH_SCENARIOS = (
    "torch_start",
    "torch_recovery",
    "torch_failure",
    "torch_stop",
    "multinode",
    "inprocess_launch",
)
"""Workers that import torch and run gloo collectives: run only when named (heavier)."""
SCENARIOS = (
    "cold_start",
    "recovery_worker_crash",
    "recovery_agent_kill",
    "drain",
    "failure_report",
    "rendezvous_scale",
    "heartbeat_capacity",
    "progress_load",
    "progress_overhead",
    "footprint",
    "coordinator_restart",
    "submit_throughput",
    "stacks",
    "event_sinks",
    "failover",
    "soak",
    *TORCH_SCENARIOS,
)
LONG_SCENARIOS = ("soak",)
"""Run only when named."""
REPLICA_SCENARIOS = ("failover",)
"""Three coordinator replicas on etcd: run only when named (they need etcd)."""
DEFAULT_SCENARIOS = tuple(
    s for s in SCENARIOS if s not in LONG_SCENARIOS + TORCH_SCENARIOS + REPLICA_SCENARIOS
)
DEFAULT_RUNS = 5
RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_JSON = RESULTS / "results.json"
SOAK_JSON = RESULTS / "soak.json"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument(
        "scenarios",
        nargs="*",
        metavar="SCENARIO",
        help=f"any of {', '.join(SCENARIOS)} "
        f"(default: all but {', '.join(LONG_SCENARIOS + TORCH_SCENARIOS + REPLICA_SCENARIOS)})",
    )
    parser.add_argument(
        "--runs", type=int, default=None, help=f"runs per scenario (default {DEFAULT_RUNS})"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="each scenario once at its smallest size (a smoke test)",
    )
    parser.add_argument(
        "--json",
        type=Path,
        default=None,
        help=f"default {DEFAULT_JSON} ({SOAK_JSON} when soak is the only scenario)",
    )
    sk = parser.add_argument_group("soak")
    sk.add_argument(
        "--minutes",
        type=float,
        default=None,
        help=f"length of the job stream (default {soak.MINUTES:g}; --quick: {soak.QUICK_MINUTES:g})",
    )
    sk.add_argument(
        "--interval",
        type=float,
        default=None,
        help=f"seconds between rows (default {soak.INTERVAL_S:g}; --quick: {soak.QUICK_INTERVAL_S:g})",
    )
    sk.add_argument(
        "--nodes",
        type=int,
        default=None,
        help=f"simulated nodes (soak: default {soak.NODES}, --quick: {soak.QUICK_NODES}; "
        "rendezvous_scale: that one size instead of its list)",
    )
    sk.add_argument(
        "--rate",
        type=float,
        default=soak.RATE,
        help="short jobs submitted per second (%(default)s)",
    )
    sk.add_argument(
        "--coordinator-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="passed on to `coordinator serve`, one word each, e.g. --coordinator-arg=--retain-jobs=200",
    )
    args = parser.parse_args(argv)
    unknown = [s for s in args.scenarios if s not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenario {unknown[0]!r}; choose from {', '.join(SCENARIOS)}")
    runs = args.runs if args.runs is not None else (1 if args.quick else DEFAULT_RUNS)
    if runs < 1:
        parser.error(f"--runs must be at least 1, got {runs}")
    chosen = args.scenarios or list(DEFAULT_SCENARIOS)
    if args.json is None:
        args.json = SOAK_JSON if chosen == ["soak"] else DEFAULT_JSON
    base = soak.quick_options() if args.quick else soak.SoakOptions()
    soak_options = soak.SoakOptions(
        minutes=args.minutes if args.minutes is not None else base.minutes,
        interval=args.interval if args.interval is not None else base.interval,
        nodes=args.nodes if args.nodes is not None else base.nodes,
        rate=args.rate,
        coordinator_args=tuple(args.coordinator_arg),
    )
    if "soak" in chosen:
        try:
            soak_options.validate()
        except ValueError as exc:
            parser.error(str(exc))
    if set(chosen) - set(LONG_SCENARIOS) and not Path(TORCHRUN).exists():
        parser.error(f"torchrun not found at {TORCHRUN}; install gelastic with its torch extra")

    measurements: list[Measurement] = []
    failed: list[str] = []
    soak_report: soak.SoakReport | None = None
    t0 = time.monotonic()
    for name in chosen:
        module = importlib.import_module(f"bench.{name}")
        if name == "soak":
            log(
                f"soak: one run of {soak_options.minutes:g} min{' (quick)' if args.quick else ''} ..."
            )
        else:
            log(f"{name}: {runs} run(s){' (quick)' if args.quick else ''} ...")
        t = time.monotonic()
        try:
            if name == "soak":  # one long run with options of its own, not `runs` short ones
                soak_report = soak.run_soak(soak_options)
                measurements += soak_report.measurements()
                if soak_report.problems():  # the rows are still written, and drawn
                    log(f"soak FAILED: {'; '.join(soak_report.problems())}")
                    failed.append(name)
            elif name == "rendezvous_scale" and args.nodes is not None:
                measurements += module.run(runs, args.quick, sizes=(args.nodes,))
            else:
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
    if soak_report is not None:
        meta["soak"] = soak_report.to_json()
    write_json(args.json, measurements, meta)
    print(render_table(measurements))
    if soak_report is not None:
        print("\nsoak, one row per interval:")
        print(soak.render_rows(soak_report.rows))
    log(f"wrote {args.json}")
    write_plots(measurements, args.json.parent)
    if soak_report is not None:
        write_soak_plot(soak_report.to_json(), args.json.parent)
    if failed:
        log(f"failed scenarios: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
