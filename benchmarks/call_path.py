"""The path of one small push + pull, traced: every call into pslaunch's own code, on each side.

    python -m benchmarks.call_path [--list]

Uses the in-process stand-ins of ``benchmarks.python_cost`` (a real ``WorkerNode`` behind
``kvcore.create('dist_sync')``, a real ``ServerNode``), warms them up, then records with
``sys.setprofile`` every call of a function of ``kvcore/`` or ``psnode/`` during one
``kv.push(k, v); kv.pull(k, out=out)`` round on the worker's calling thread, and during one round of
two workers' messages (built beforehand) on the server's thread. Prints how many calls and how many files each side
takes; ``--list`` prints the calls in order (file:function), the path docs/runtime.md draws.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path
from typing import Callable

import click

from . import python_cost

_ROOT = Path(__file__).resolve().parents[1]
_PACKAGES = (str(_ROOT / "kvcore") + "/", str(_ROOT / "psnode") + "/")
_STAND_IN = "_StandIn."  # the rest of the job, played by python_cost: its calls are not the node's


def _trace(run: Callable[[], None]) -> list[str]:
    """``file:function`` of every call of pslaunch's code while ``run()`` runs on this thread."""
    calls: list[str] = []

    def profile(frame, event, arg) -> None:
        if event == "call":
            path = frame.f_code.co_filename
            caller = frame.f_back.f_code.co_qualname if frame.f_back is not None else ""
            if path.startswith(_PACKAGES) and not caller.startswith(_STAND_IN):  # not the stand-in's own work
                calls.append(f"{Path(path).relative_to(_ROOT)}:{frame.f_code.co_qualname}")

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return calls


def worker_path() -> list[str]:
    """The calls of one push + pull round of a 4-float key on the worker's calling thread."""
    kv, rounds = python_cost.worker_rounds()
    try:
        rounds(200)  # warm: the network thread parks, the push waits for the pull
        return _trace(lambda: rounds(1))
    finally:
        python_cost.stop_worker(kv)


def server_path() -> list[str]:
    """The calls of one round of two workers' PUSH_PULL frames on the server's thread."""
    messages, deliver = python_cost.server_rounds()
    for _ in range(200):
        deliver(messages())
    batch = messages()
    return _trace(lambda: deliver(batch))


def _summary(side: str, calls: list[str], listing: bool) -> None:
    files = Counter(c.split(":")[0] for c in calls)
    click.echo(f"{side}: {len(calls)} calls in {len(files)} files ({', '.join(sorted(files))})")
    if listing:
        for call in calls:
            click.echo(f"    {call}")


@click.command(help=__doc__.split("\n\n")[0])
@click.option("--list", "listing", is_flag=True, help="Print every call in order.")
def main(listing: bool) -> None:
    _summary("worker", worker_path(), listing)
    _summary("server", server_path(), listing)


if __name__ == "__main__":
    main()
