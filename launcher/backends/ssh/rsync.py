"""``--sync-dst-dir``: copy the current directory to every host with rsync before the job starts.

One rsync per distinct host, all in parallel, over ssh with the same options as the job
(port, identity, known-hosts file and host-key policy). ``.git``, ``__pycache__`` and ``.venv``
are left out. The destination is created first (``mkdir -p`` over the job's ssh connection). Any
rsync that fails stops the launch with a ``SyncError`` naming the host, rsync's exit code and
the last lines it printed. On a terminal a rich progress display shows each host.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

from ...errors import SyncError
from ...planning.hostfile import Host

__all__ = ["sync_all", "rsync_argv", "EXCLUDES"]

#: Never copied.
EXCLUDES = (".git", "__pycache__", ".venv")
_PERCENT = re.compile(rb"(\d+)%")


def rsync_argv(ssh_argv: list[str], src: str, destination: str, dst_dir: str) -> list[str]:
    """rsync's argv: archive mode, compression, excludes, ``-e`` with the quoted ssh command."""
    argv = ["rsync", "-az", "--info=progress2", "--no-inc-recursive"]
    argv += [f"--exclude={name}" for name in EXCLUDES]
    # --protect-args: the remote path reaches rsync unsplit, spaces and quotes and all.
    argv += ["--protect-args", "-e", shlex.join(ssh_argv), src.rstrip("/") + "/", f"{destination}:{dst_dir.rstrip('/')}/"]
    return argv


def _sync_one(connector, host: Host, src: str, dst: str, client, timeout: float, progress) -> float:
    from .connection import run_remote_output

    label = host.label
    start = time.monotonic()
    code, err = run_remote_output(client, ["mkdir", "-p", "--", dst], timeout)
    if code != 0:
        raise SyncError(f"rsync to {label}: cannot create {dst!r} there (mkdir exit {code}): {err}")
    argv = rsync_argv(connector.ssh_argv(host), src, connector.destination(host), dst)
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    try:
        for chunk in iter(lambda: proc.stdout.read1(4096), b""):  # type: ignore[union-attr]
            found = _PERCENT.findall(chunk)
            if found and progress is not None:
                progress(host, int(found[-1]))
        _, stderr = proc.communicate(timeout=timeout)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    if proc.returncode != 0:
        lines = stderr.decode("utf-8", "replace").strip().splitlines()[-3:]
        raise SyncError(f"rsync to {label}:{dst} failed with exit code {proc.returncode}: " + " / ".join(lines))
    if progress is not None:
        progress(host, 100)
    return time.monotonic() - start


def sync_all(connector, hosts: list[Host], src: str, dst: str, clients: dict, printer, config) -> None:
    """rsync ``src`` to ``dst`` on every host in ``hosts`` in parallel. Blocks until all finished.

    Raises ``SyncError`` naming each failing host (the others still finish first).
    """
    if not hosts:
        return
    timeout = max(600.0, config.timeout or 0)
    use_rich = printer.colour and not config.quiet
    errors: list[str] = []
    if use_rich:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        printer.flush()  # the progress display writes the terminal itself, after what is queued
        console = Console(file=printer.err)
        with Progress(TextColumn("rsync → {task.description}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
                      TimeElapsedColumn(), console=console, transient=False) as bar:
            tasks = {h: bar.add_task(f"{h.label}:{dst}", total=100) for h in hosts}
            errors = _run(connector, hosts, src, dst, clients, timeout, lambda h, pct: bar.update(tasks[h], completed=pct))
    else:
        errors = _run(connector, hosts, src, dst, clients, timeout, None)
        if not errors and not config.quiet:
            printer.note(f"rsync: {src} -> {dst} on {len(hosts)} host(s) done")
    if errors:
        raise SyncError("\n  ".join(["code sync failed:"] + errors))


def _run(connector, hosts, src, dst, clients, timeout, progress) -> list[str]:
    with ThreadPoolExecutor(max_workers=min(16, len(hosts))) as pool:
        futures = {h: pool.submit(_sync_one, connector, h, src, dst, clients[h], timeout, progress) for h in hosts}
    errors = []
    for host, fut in futures.items():
        exc = fut.exception()
        if exc is not None:
            errors.append(str(exc) if isinstance(exc, SyncError) else f"rsync to {host.label}: {type(exc).__name__}: {exc}")
    return errors
