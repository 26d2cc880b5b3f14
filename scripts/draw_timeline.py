"""Draw a pslaunch timeline (Chrome trace JSON) as an SVG picture, for the docs.

    python scripts/draw_timeline.py trace.json out.svg [--start-ms 1000] [--span-ms 40]

One band per trace process (scheduler, servers, workers, as the trace names them), one lane per
thread, each complete event a box whose depth in the lane is its nesting (a wait inside a pull
sits below it); boxes are coloured by the event's first word (push, pull, wait, merge, update ...)
and labelled when wide enough. ``--start-ms`` is where the window starts after the first event,
``--span-ms`` how much it shows. The SVG is plain text: no browser, no plotting library.
"""

from __future__ import annotations

import argparse
import html
import json
from collections import defaultdict

COLOURS = {"push": "#4c78a8", "pull": "#59a14f", "pushpull": "#76b7b2", "wait": "#e0e0e0", "merge": "#f28e2b",
           "update": "#e15759", "barrier": "#b07aa1", "register": "#9c755f", "registration": "#9c755f",
           "init": "#bab0ac"}
WIDTH, LEFT, ROW, PAD = 1100, 150, 16, 6


def draw(events: list[dict], start_ms: float, span_ms: float) -> str:
    """The SVG text of the window ``start_ms`` .. ``start_ms + span_ms`` after the first event."""
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    spans = [e for e in events if e.get("ph") == "X"]
    origin = min(e["ts"] for e in spans) + start_ms * 1000
    end = origin + span_ms * 1000
    lanes: dict[tuple[int, int], list[tuple[float, float, str, int]]] = defaultdict(list)
    for tid_key in sorted({(e["pid"], e["tid"]) for e in spans}):
        track = sorted((e for e in spans if (e["pid"], e["tid"]) == tid_key), key=lambda e: (e["ts"], -e["dur"]))
        stack: list[float] = []
        for event in track:
            while stack and stack[-1] <= event["ts"]:
                stack.pop()
            if event["ts"] < end and event["ts"] + event["dur"] > origin:
                lanes[tid_key].append((event["ts"], event["dur"], event["name"], len(stack)))
            stack.append(event["ts"] + event["dur"])
    scale = (WIDTH - LEFT - PAD) / (end - origin)
    parts, y = [], PAD + 18
    for (pid, tid), boxes in sorted(lanes.items()):
        depth = 1 + max(d for *_, d in boxes)
        label = html.escape(names.get(pid, str(pid)).split(" (")[0] + ("" if tid == 1 else f" t{tid}"))
        parts.append(f'<text x="{PAD}" y="{y + ROW - 4}" font-size="11">{label}</text>')
        parts.append(f'<line x1="{LEFT}" y1="{y + depth * ROW + 2}" x2="{WIDTH - PAD}" y2="{y + depth * ROW + 2}" '
                     'stroke="#ddd"/>')
        for ts, dur, name, level in boxes:
            x0 = LEFT + max(0.0, ts - origin) * scale
            x1 = LEFT + min(end - origin, ts + dur - origin) * scale
            colour = COLOURS.get(name.split(" ")[0], "#cccccc")
            top = y + level * ROW
            parts.append(f'<rect x="{x0:.1f}" y="{top}" width="{max(0.6, x1 - x0):.1f}" height="{ROW - 2}" '
                         f'fill="{colour}" stroke="#555" stroke-width="0.3"><title>{html.escape(name)} '
                         f'{dur / 1000:.3f} ms</title></rect>')
            if x1 - x0 > 7 * len(name):
                parts.append(f'<text x="{x0 + 2:.1f}" y="{top + ROW - 5}" font-size="10">{html.escape(name)}</text>')
        y += depth * ROW + 8
    axis = []
    for i in range(11):
        x = LEFT + i * (WIDTH - LEFT - PAD) / 10
        axis.append(f'<text x="{x:.1f}" y="12" font-size="10" text-anchor="middle">{start_ms + i * span_ms / 10:g} ms</text>')
    height = y + PAD
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
            f'font-family="DejaVu Sans, sans-serif">\n<rect width="100%" height="100%" fill="white"/>\n'
            + "\n".join(axis + parts) + "\n</svg>\n")


def main() -> None:
    """Read the trace, write the SVG."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace")
    parser.add_argument("svg")
    parser.add_argument("--start-ms", type=float, default=0.0)
    parser.add_argument("--span-ms", type=float, default=50.0)
    args = parser.parse_args()
    with open(args.trace, encoding="utf-8") as fh:
        events = json.load(fh)
    with open(args.svg, "w", encoding="utf-8") as fh:
        fh.write(draw(events, args.start_ms, args.span_ms))


if __name__ == "__main__":
    main()
