"""Summarise the profiles written by ``run.py --profile-dir DIR``: where pslaunch's time goes.

    python benchmarks/profile_summary.py DIR [--top 25]

For each pstats file (``*.server.prof``: cProfile of the server's main thread; ``*.prof.rank<r>``:
yappi CPU time of every thread of a worker, or cProfile of its main thread) it prints the functions
with the most cumulative and internal time. For py-spy folded stacks (``*.folded``, from
``py-spy record -f raw``) it prints the frames with the most samples, on top of the stack and anywhere
in it.
"""

from __future__ import annotations

import collections
import pstats
import re
import sys
from pathlib import Path

import click


_LINE = re.compile(r":\d+\)$")


def summarise_folded(path: Path, top: int, by_line: bool = False) -> str:
    """Top self and inclusive frames of a py-spy raw (folded) profile, by function unless ``by_line``."""
    own: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = stack.split(";")
        if not by_line:
            frames = [_LINE.sub(")", f) for f in frames]
        total += count
        own[frames[-1]] += count
        for frame in set(frames):
            incl[frame] += count
    lines = [f"== {path.name}: {total} samples (on CPU)"]
    for title, counter in (("self", own), ("inclusive", incl)):
        lines.append(f"-- top {top} by {title}")
        for frame, count in counter.most_common(top):
            lines.append(f"{100 * count / max(total, 1):6.1f}%  {frame}")
    return "\n".join(lines)


def summarise_cprofile(path: Path, top: int) -> str:
    """Top cumulative and internal-time functions of a cProfile dump."""
    import io

    lines = [f"== {path.name}"]
    for key in ("cumulative", "tottime"):
        buf = io.StringIO()
        stats = pstats.Stats(str(path), stream=buf)
        stats.strip_dirs().sort_stats(key).print_stats(top)
        text = buf.getvalue()
        start = text.find("   ncalls")
        lines.append(f"-- by {key}\n{text[start:].rstrip()}")
    return "\n".join(lines)


@click.command()
@click.argument("directory", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--top", type=click.IntRange(1, 200), default=25, show_default=True)
@click.option("--by-line", is_flag=True, help="Keep line numbers: one entry per source line, not per function.")
def main(directory: Path, top: int, by_line: bool) -> None:
    """Print the summaries of every profile in DIRECTORY."""
    found = False
    for path in sorted(directory.iterdir()):
        if path.name.endswith(".folded"):
            click.echo(summarise_folded(path, top, by_line))
            found = True
        elif path.name.endswith(".prof") or (".prof.rank" in path.name and not path.name.endswith(".threads")):
            click.echo(summarise_cprofile(path, top))
            found = True
    if not found:
        click.echo(f"no profiles in {directory}", err=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
