"""Summarise the profiles written by ``run.py --profile-dir DIR``: where pslaunch's time goes.

    python benchmarks/profile_summary.py DIR [--top 25]

For each ``*.server.folded`` (py-spy samples of the server, one folded stack per line) it prints the
functions with the most samples on top of the stack (self) and anywhere in it (inclusive); for each
``*.prof.rank<r>`` (cProfile of a worker's whole suite) the functions with the most cumulative and
internal time.
"""

from __future__ import annotations

import collections
import pstats
import sys
from pathlib import Path

import click


def summarise_folded(path: Path, top: int) -> str:
    """Top self and inclusive frames of a py-spy raw (folded) profile."""
    own: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = stack.split(";")
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
def main(directory: Path, top: int) -> None:
    """Print the summaries of every profile in DIRECTORY."""
    found = False
    for path in sorted(directory.iterdir()):
        if path.name.endswith(".folded"):
            click.echo(summarise_folded(path, top))
            found = True
        elif ".prof.rank" in path.name:
            click.echo(summarise_cprofile(path, top))
            found = True
    if not found:
        click.echo(f"no profiles in {directory}", err=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
