"""Charts of the scale benchmarks: rendezvous time and heartbeat CPU against the number of nodes,
and the soak's curves over time.

`write_plots(measurements, out_dir)` draws whatever of `rendezvous_scale` and
`heartbeat_capacity` the measurements hold into `out_dir/rendezvous_scale.png` and
`out_dir/heartbeat_capacity.png`; `write_soak_plot(doc, out_dir)` draws a soak's rows (the
results JSON's `meta.soak`) into `out_dir/soak.png`: coordinator RSS, state-dir size and Submit
p99 against time, one panel each. `python -m bench._plots [results.json ...]` draws them again
from results files. matplotlib is optional: without it this prints one line and draws nothing.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench._common import Measurement, log

__all__ = ["write_plots", "write_soak_plot"]

_SIZED = re.compile(r"^N=(\d+) (.+)$")
DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "results.json"

# (metric without its "N=n " prefix, legend label)
_RENDEZVOUS = [
    ("submit -> all assigned", "submit -> every node has its Assign"),
    ("submit -> all started", "submit -> coordinator processed every WorkersStarted"),
]
_HEARTBEAT = [
    ("coordinator CPU (cores)", "coordinator"),
    ("simulated agents CPU (cores)", "simulated agents (2 processes)"),
]


def _series(
    measurements: Sequence[Measurement], scenario: str, metric: str
) -> list[tuple[int, float, float, float]]:
    """(N, median, min, max) of `metric` at every size, by N."""
    out = []
    for m in measurements:
        match = _SIZED.match(m.metric)
        if m.scenario != scenario or not match or match.group(2) != metric:
            continue
        if m.median is None or m.min is None or m.max is None:
            continue
        out.append((int(match.group(1)), m.median, m.min, m.max))
    return sorted(out)


def write_plots(measurements: Sequence[Measurement], out_dir: Path) -> list[Path]:
    """Draw the charts the measurements allow; returns the files written."""
    rendezvous = {label: _series(measurements, "rendezvous_scale", m) for m, label in _RENDEZVOUS}
    heartbeat = {label: _series(measurements, "heartbeat_capacity", m) for m, label in _HEARTBEAT}
    if not any(rendezvous.values()) and not any(heartbeat.values()):
        return []
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("plots: skipped (matplotlib is not installed: pip install matplotlib)")
        return []

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    if any(rendezvous.values()):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for label, points in rendezvous.items():
            if points:
                _errorbar(ax, points, label)
        ax.plot([1000, 10000], [1.0, 10.0], "k:", label="target: 1 s at 1000, linear")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("nodes in the job (N)")
        ax.set_ylabel("seconds (median; bars: min-max)")
        ax.set_title("Rendezvous of one N-node job on simulated nodes")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        path = out_dir / "rendezvous_scale.png"
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    if any(heartbeat.values()):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for label, points in heartbeat.items():
            if points:
                _errorbar(ax, points, label)
        ax.axhline(0.5, color="k", linestyle=":", label="target for the coordinator at 5000")
        ax.set_xlabel("nodes heartbeating at 1 Hz (N)")
        ax.set_ylabel("CPU cores (median; bars: min-max)")
        ax.set_title("CPU spent on heartbeats with worker health")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        path = out_dir / "heartbeat_capacity.png"
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    for p in written:
        log(f"plots: wrote {p}")
    return written


def write_soak_plot(doc: Mapping[str, Any], out_dir: Path) -> Path | None:
    """Three panels against minutes since the first submit: RSS, state dir, Submit p99."""
    rows = list(doc.get("rows", []))
    if not rows:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("plots: skipped (matplotlib is not installed: pip install matplotlib)")
        return None

    opts = doc.get("options", {})
    minutes = [r["t_s"] / 60 for r in rows]
    fig, (rss, db, p99) = plt.subplots(3, 1, figsize=(7, 8.5), sharex=True)
    rss.plot(minutes, [r["rss_mb"] for r in rows], marker="o", markersize=3, label="coordinator")
    rss.set_ylabel("RSS (MB)")
    rss.set_ylim(bottom=0)
    db.plot(minutes, [r["state_mb"] for r in rows], marker="o", markersize=3, label="state dir")
    db.plot(minutes, [r["db_mb"] for r in rows], linestyle="--", label="SQLite file")
    db.plot(minutes, [r["wal_mb"] for r in rows], linestyle=":", label="WAL")
    db.set_ylabel("size (MB)")
    db.set_ylim(bottom=0)
    timed = [(m, r) for m, r in zip(minutes, rows, strict=True) if r["submit_p99_ms"] is not None]
    p99.plot(
        [m for m, _ in timed],
        [r["submit_p99_ms"] for _, r in timed],
        marker="o",
        markersize=3,
        label="p99",
    )
    p99.plot([m for m, _ in timed], [r["submit_p50_ms"] for _, r in timed], "--", label="p50")
    p99.set_ylabel("Submit latency (ms)")
    p99.set_ylim(bottom=0)
    p99.set_xlabel("minutes since the first submit")
    for ax in (rss, db, p99):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    extra = " ".join(opts.get("coordinator_args", []))
    fig.suptitle(
        f"Soak: {opts.get('nodes', '?')} simulated nodes, {opts.get('rate', '?')} short jobs/s"
        + (f"\ncoordinator serve {extra}" if extra else ""),
        fontsize=10,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "soak.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    log(f"plots: wrote {path}")
    return path


def _errorbar(ax: object, points: list[tuple[int, float, float, float]], label: str) -> None:
    xs = [p[0] for p in points]
    med = [p[1] for p in points]
    lo = [p[1] - p[2] for p in points]
    hi = [p[3] - p[1] for p in points]
    ax.errorbar(xs, med, yerr=[lo, hi], marker="o", capsize=3, label=label)  # type: ignore[attr-defined]


def _load(path: Path) -> list[Measurement]:
    doc = json.loads(path.read_text())
    return [
        Measurement(
            scenario=m["scenario"],
            metric=m["metric"],
            system=m["system"],
            values=list(m["values"]),
            timeouts=m.get("timeouts", 0),
            note=m.get("note", ""),
        )
        for m in doc["measurements"]
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench._plots", description=__doc__)
    parser.add_argument(
        "json", nargs="*", type=Path, default=[DEFAULT_JSON], help="results files to draw from"
    )
    parser.add_argument("--out", type=Path, default=None, help="default: next to the first JSON")
    args = parser.parse_args(argv)
    measurements = [m for path in args.json for m in _load(path)]
    out = args.out or args.json[0].parent
    written = write_plots(measurements, out)
    for path in args.json:
        soak = json.loads(path.read_text())["meta"].get("soak")
        if soak:
            drawn = write_soak_plot(soak, out)
            written += [drawn] if drawn else []
    if not written:
        log(f"plots: nothing to draw from {', '.join(map(str, args.json))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
