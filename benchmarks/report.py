"""Turning the jobs' figures into rows, ratios and targets, and showing them (rich or plain text).

A row is one measure (``pushpull_4194304``, ``roundtrip_4elem``, ...) with the median over the
repetitions for every system. A ratio is pslaunch's figure divided by a baseline's, in the row's own
unit: above 1 is better for throughput, below 1 is better for times. Because the machine is shared
and noisy, a ratio is the median of the per-repetition ratios (each repetition runs every system
back to back), not the ratio of two medians taken minutes apart.
"""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Row", "build_rows", "build_ratios", "build_targets", "machine_info", "render", "fmt_value"]

MiB = 1 << 20

# (ours, baseline) pairs shown as ratio columns
RATIO_PAIRS = [
    ("pslaunch_tcp", "mxnet_tcp"),
    ("pslaunch_fast", "mxnet_tcp"),
    ("pslaunch_fast", "mxnet_ipc"),
    ("pslaunch_tcp", "zmq_tcp"),
    ("pslaunch_fast", "zmq_ipc"),
    ("pslaunch_ipc", "zmq_ipc"),
    ("pslaunch_tcp", "pslaunch_tcp_normal"),
    ("pslaunch_tcp", "pslaunch_tcp_noauth"),
    ("pslaunch_fast", "pslaunch_fast_noauth"),
    ("pslaunch_tcp_curve", "pslaunch_tcp"),
    ("pslaunch_tcp_timeline", "pslaunch_tcp"),
    ("pslaunch_tcp", "pslaunch_tcp_nolanes"),
    ("pslaunch_tcp_nocopy", "zmq_tcp"),
    ("pslaunch_tcp", "pslaunch_tcp_nostreams"),
    ("pslaunch_fast", "pslaunch_fast_nostreams"),
]

# the data path's targets (issue 42): (name, measure, ours, baseline, op, threshold)
TARGETS = [
    ("push+pull 4 MiB over TCP >= 0.9x raw pyzmq", f"pushpull_{4 * MiB}", "pslaunch_tcp", "zmq_tcp", ">=", 0.9),
    ("push+pull 16 MiB over TCP >= 0.9x raw pyzmq", f"pushpull_{16 * MiB}", "pslaunch_tcp", "zmq_tcp", ">=", 0.9),
    ("push+pull 64 MiB over TCP >= 0.9x raw pyzmq", f"pushpull_{64 * MiB}", "pslaunch_tcp", "zmq_tcp", ">=", 0.9),
    ("4-element round trip <= 1.2x raw pyzmq's echo (TCP)", "roundtrip_4elem", "pslaunch_tcp", "zmq_tcp", "<=", 1.2),
    ("4-element round trip <= 1.2x raw pyzmq's echo (same host)", "roundtrip_4elem", "pslaunch_fast", "zmq_ipc", "<=",
     1.2),
    ("push+pull 4 MiB same host >= 4x MXNet", f"pushpull_{4 * MiB}", "pslaunch_fast", "mxnet_tcp", ">=", 4.0),
    ("1000 small keys <= 0.05x MXNet (TCP)", "many_1000x1float", "pslaunch_tcp", "mxnet_tcp", "<=", 0.05),
    ("1000 small keys <= 0.05x MXNet (same host)", "many_1000x1float", "pslaunch_fast", "mxnet_tcp", "<=", 0.05),
]


@dataclass
class Row:
    """One measure: its label, unit, which direction is better, and each system's figures."""

    measure: str
    label: str
    unit: str  # "B/s", "us" or "ms"
    higher_is_better: bool
    per_rep: dict[str, list[float | None]]
    push_call: dict[str, list[float]] = field(default_factory=dict)  # time until push() returned

    def median(self, system: str) -> float | None:
        """Median over the repetitions that produced a figure (None when none did)."""
        values = [v for v in self.per_rep.get(system, []) if v is not None]
        return statistics.median(values) if values else None

    def to_json(self, systems: list[str]) -> dict[str, Any]:
        return {
            "measure": self.measure, "label": self.label, "unit": self.unit,
            "better": "higher" if self.higher_is_better else "lower",
            "values": {s: self.median(s) for s in systems},
            "per_rep": {s: self.per_rep.get(s, []) for s in systems},
            # KV stores only: median time until push() returned, in the row's time unit
            "push_call": {s: statistics.median(v) for s, v in self.push_call.items() if v},
        }


def _size_label(nbytes: int) -> str:
    if nbytes % MiB == 0:
        return f"{nbytes // MiB} MiB"
    return f"{nbytes / 1024:g} KiB"


def build_rows(sizes: list[int], many_keys: int, systems: list[str], reps: list[dict[str, dict | None]]) -> list[Row]:
    """Rows for every measure; ``reps[i][system]`` is that job's result (None when it failed)."""
    specs = [(f"pushpull_{n}", f"push+pull {_size_label(n)}, per worker", "B/s", True) for n in sizes]
    specs.append(("roundtrip_4elem", "4-element key push+pull round trip", "us", False))
    specs.append((f"many_{many_keys}x1float", f"{many_keys} one-float keys, per round", "ms", False))
    specs += [(f"oneway_{n}", f"one-way {_size_label(n)} frames, per sender", "B/s", True) for n in sizes]
    rows = []
    for measure, label, unit, higher in specs:
        per_rep: dict[str, list[float | None]] = {}
        push_call: dict[str, list[float]] = {}
        for system in systems:
            values = []
            for rep in reps:
                result = rep.get(system)
                figure = (result or {}).get("measures", {}).get(measure)
                if figure is None:
                    values.append(None)
                    continue
                values.append(figure["bytes_per_s"] if unit == "B/s" else figure["median"])
                if "push_call_median" in figure:
                    push_call.setdefault(system, []).append(figure["push_call_median"])
            per_rep[system] = values
        rows.append(Row(measure, label, unit, higher, per_rep, push_call))
    return rows


def _paired_ratio(row: Row, ours: str, base: str) -> float | None:
    pairs = [(a, b) for a, b in zip(row.per_rep.get(ours, []), row.per_rep.get(base, [])) if a and b]
    return statistics.median(a / b for a, b in pairs) if pairs else None


def build_ratios(rows: list[Row]) -> list[dict[str, Any]]:
    """Every ratio of ``RATIO_PAIRS`` for every row where both systems have figures."""
    out = []
    for row in rows:
        for ours, base in RATIO_PAIRS:
            ratio = _paired_ratio(row, ours, base)
            if ratio is not None:
                out.append({"measure": row.measure, "ours": ours, "baseline": base, "ratio": ratio})
    return out


def build_targets(rows: list[Row]) -> list[dict[str, Any]]:
    """The data path's targets (issue 42), each with its ratio and whether it is met (None: not measured this run)."""
    by_measure = {r.measure: r for r in rows}
    out = []
    for name, measure, ours, base, op, threshold in TARGETS:
        row = by_measure.get(measure)
        ratio = _paired_ratio(row, ours, base) if row else None
        met = None if ratio is None else (ratio >= threshold if op == ">=" else ratio <= threshold)
        out.append({"target": name, "measure": measure, "ours": ours, "baseline": base, "op": op,
                    "threshold": threshold, "ratio": ratio, "met": met})
    return out


def fmt_value(value: float | None, unit: str) -> str:
    """A figure for the table: MB/s or GB/s, µs, ms."""
    if value is None:
        return "-"
    if unit == "B/s":
        return f"{value / 1e9:.2f} GB/s" if value >= 1e9 else f"{value / 1e6:.0f} MB/s"
    if unit == "us":
        return f"{value:.0f} µs"
    return f"{value:.1f} ms" if value < 1000 else f"{value / 1e3:.2f} s"


def machine_info() -> dict[str, Any]:
    """What the figures were measured on: CPU, core count, memory, versions, load."""
    info: dict[str, Any] = {"nproc": os.cpu_count(), "platform": platform.platform(),
                            "python": platform.python_version()}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                info["mem_total_kib"] = int(line.split()[1])
                break
    except OSError:
        pass
    info["loadavg_start"] = list(os.getloadavg())
    try:
        import numpy
        import zmq

        info.update(numpy=numpy.__version__, pyzmq=zmq.__version__, libzmq=zmq.zmq_version())
    except ImportError:
        pass
    try:
        info["git_commit"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
            text=True, timeout=10, check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def _ratio_cell(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def _target_cell(ratio: float | None) -> str:
    # one more digit than the table: a target is judged on the unrounded ratio
    return "-" if ratio is None else f"{ratio:.3f}x"


def render(report: dict[str, Any], rows: list[Row], systems: list[str], statuses: dict[str, str]) -> str:
    """The figures, ratios and targets as text (a rich table when rich is installed)."""
    pairs = [(o, b) for o, b in RATIO_PAIRS if o in systems and b in systems]
    headers = ["measure"] + systems + [f"{o.split('_')[1]}/{b.replace('_', ' ')}" for o, b in pairs]
    body = []
    for row in rows:
        if all(row.median(s) is None for s in systems):
            continue
        cells = [row.label]
        for s in systems:
            value = row.median(s)
            cells.append(fmt_value(value, row.unit) if value is not None else _missing(s, statuses, row))
        cells += [_ratio_cell(_paired_ratio(row, o, b)) for o, b in pairs]
        body.append(cells)
    target_rows = [
        [t["target"], _target_cell(t["ratio"]), {True: "met", False: "NOT met", None: "not measured"}[t["met"]]]
        for t in report["targets"]
    ]
    status_line = ", ".join(f"{s}: {statuses[s]}" for s in systems)
    try:
        return _render_rich(headers, body, target_rows, report, status_line)
    except ImportError:
        return _render_plain(headers, body, target_rows, report, status_line)


def _produces(system: str, measure: str) -> bool:
    """Whether ``system`` measures ``measure`` at all (raw pyzmq has no keys; KV stores no one-way stream)."""
    if system.startswith("zmq_"):
        return not measure.startswith("many_")
    return not measure.startswith("oneway_")


def _missing(system: str, statuses: dict[str, str], row: Row) -> str:
    status = statuses.get(system, "")
    if status != "ok" and _produces(system, row.measure):
        return status
    return "n/a"


def _render_rich(headers, body, target_rows, report, status_line) -> str:
    import io

    from rich.console import Console
    from rich.table import Table

    console = Console(record=True, width=200, file=io.StringIO())
    machine = report["machine"]
    bound = ", each process on one core (--cpu-bind)" if report.get("config", {}).get("cpu_bind") else ""
    table = Table(title=f"pslaunch benchmarks — {machine.get('cpu_model', '?')}, {machine['nproc']} cores{bound}")
    for i, h in enumerate(headers):
        table.add_column(h, justify="left" if i == 0 else "right")
    for cells in body:
        table.add_row(*cells)
    console.print(table)
    targets = Table(title="data path targets (issue 42; ratio = pslaunch / baseline)")
    for h in ("target", "ratio", "status"):
        targets.add_column(h)
    for cells in target_rows:
        targets.add_row(*cells)
    console.print(targets)
    console.print(status_line)
    return console.export_text()


def _render_plain(headers, body, target_rows, report, status_line) -> str:
    lines = []
    for table in ([headers] + body, [["target", "ratio", "status"]] + target_rows):
        widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
        for r in table:
            lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)))
        lines.append("")
    lines.append(status_line)
    return "\n".join(lines)


def markdown(report: dict[str, Any]) -> str:
    """The figures, ratios and targets of a JSON report as Markdown tables (for docs/benchmarks.md)."""
    systems = [s for s, info in report["systems"].items() if info["status"] != "skipped"]
    pairs = [(o, b) for o, b in RATIO_PAIRS if o in systems and b in systems]
    ratio_of = {(r["measure"], r["ours"], r["baseline"]): r["ratio"] for r in report["ratios"]}
    head = ["measure"] + systems + [f"{o.replace('_', ' ')} / {b.replace('_', ' ')}" for o, b in pairs]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in report["rows"]:
        values = row["values"]
        if all(values.get(s) is None for s in systems):
            continue
        cells = [row["label"]]
        for s in systems:
            status = report["systems"][s]["status"]
            cells.append(fmt_value(values.get(s), row["unit"]) if values.get(s) is not None
                         else (status if status != "ok" and _produces(s, row["measure"]) else "n/a"))
        cells += [_ratio_cell(ratio_of.get((row["measure"], o, b))) for o, b in pairs]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "| target (issue 42) | pslaunch / baseline | met? |", "|---|---|---|"]
    for t in report["targets"]:
        status = {True: "yes", False: "**no**", None: "not measured"}[t["met"]]
        lines.append(f"| {t['target']} | {_target_cell(t['ratio'])} | {status} |")
    return "\n".join(lines) + "\n"
