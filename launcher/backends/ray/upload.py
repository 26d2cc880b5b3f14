"""What Ray would upload as the job's ``working_dir``, sized before anything is zipped.

Ray packs pslaunch's directory into a zip and sends it to every node, leaving out what ``.gitignore``
and ``.rayignore`` name (in every folder, as git does), ``__pycache__`` and the ``excludes`` of the
``runtime_env``. Ray learns the size only as it zips: a directory holding a data set, a virtualenv or
Ray's own session files once took minutes and filled a disk with a 50 GB zip before Ray gave up. So
``package_size`` walks the directory first, with the same rules (Ray's own copy of ``pathspec``
matches the patterns when Ray is installed), and stops counting as soon as the total passes the
limit; ``check_working_dir`` then refuses with the biggest entries named, before Ray starts.

What Ray itself writes is never uploaded: a folder holding a Ray session (``session_latest`` or
``session_<date>`` folders with ``logs`` and ``sockets``) is left out whatever the ignore files say.
"""

from __future__ import annotations

import fnmatch
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from ...errors import SyncError

__all__ = ["PackageSize", "package_size", "check_working_dir", "package_limit", "PACKAGE_LIMIT"]

#: Ray's limit on a package: its gRPC message limit, 512 MiB unless ``RAY_max_grpc_message_size`` says.
PACKAGE_LIMIT = 512 << 20
#: Seconds the walk may go on past the limit to name the biggest entries better.
_NAMING_BUDGET = 2.0
_ALWAYS_LEFT_OUT = ("__pycache__",)


@dataclass
class PackageSize:
    """The bytes Ray would pack: ``total`` (at least, when ``complete`` is False: the walk stopped
    early) and the bytes under each top-level entry, as far as the walk went."""

    total: int = 0
    complete: bool = True
    by_entry: dict[str, int] = field(default_factory=dict)
    left_out: list[str] = field(default_factory=list)  # Ray session folders left out, relative paths

    def biggest(self, count: int = 5) -> list[tuple[str, int]]:
        return sorted(self.by_entry.items(), key=lambda item: -item[1])[:count]


def _matcher(patterns: Sequence[str]) -> Callable[[str], bool]:
    """A ``match(relative_path)`` for gitignore-style ``patterns``: Ray's own matcher when Ray is
    installed (the same rules it applies), else ``fnmatch`` on the path and on its name."""
    patterns = [p.rstrip("\n") for p in patterns if p.strip() and not p.lstrip().startswith("#")]
    if not patterns:
        return lambda _: False
    try:
        from ray._private.thirdparty.pathspec import PathSpec

        spec = PathSpec.from_lines("gitwildmatch", patterns)
        return spec.match_file
    except ImportError:
        plain = [p.strip().strip("/") for p in patterns]
        return lambda rel: any(fnmatch.fnmatch(rel, p) or fnmatch.fnmatch(os.path.basename(rel), p) for p in plain)


def _ignore_file(folder: str, name: str) -> Callable[[str], bool] | None:
    path = os.path.join(folder, name)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, errors="replace") as fh:
            return _matcher(fh.readlines())
    except OSError:
        return None


def _is_ray_session(path: str, names: set[str]) -> bool:
    """A folder Ray made for a session: its temp root (``session_latest`` in it) or a session itself."""
    if "session_latest" in names:
        return True
    base = os.path.basename(path)
    return base.startswith("session_") and {"logs", "sockets"} <= names


def package_size(root: str, excludes: Sequence[str] = (), limit: int = PACKAGE_LIMIT,
                 clock: Callable[[], float] = time.monotonic) -> PackageSize:
    """Walk ``root`` as Ray packs it (see the module docstring) and add up the bytes of the files it
    would take; once past ``limit`` the walk goes on at most ``_NAMING_BUDGET`` seconds more, to name
    the biggest entries, and the result is then marked incomplete."""
    size = PackageSize()
    root = os.path.abspath(root)
    top = _matcher(list(excludes))
    deadline: float | None = None

    def walk(folder: str, rules: list[tuple[str, Callable[[str], bool]]]) -> bool:
        nonlocal deadline
        rules = list(rules)
        for name in (".gitignore", ".rayignore"):
            match = _ignore_file(folder, name)
            if match is not None:
                rules.append((folder, match))
        try:
            entries = list(os.scandir(folder))
        except OSError:
            return True
        names = {e.name for e in entries}
        if folder != root and _is_ray_session(folder, names):
            size.left_out.append(os.path.relpath(folder, root))
            return True
        for entry in sorted(entries, key=lambda e: e.name):
            if entry.name in _ALWAYS_LEFT_OUT:
                continue
            rel = os.path.relpath(entry.path, root)
            if top(rel) or any(match(os.path.relpath(entry.path, base)) for base, match in rules):
                continue
            try:
                is_dir = entry.is_dir(follow_symlinks=False)
                nbytes = 0 if is_dir else entry.stat(follow_symlinks=False).st_size
            except OSError:
                continue
            if is_dir:
                if not walk(entry.path, rules):
                    return False
                continue
            size.total += nbytes
            head = rel.split(os.sep, 1)[0] + ("/" if os.sep in rel else "")
            size.by_entry[head] = size.by_entry.get(head, 0) + nbytes
            if size.total > limit:
                if deadline is None:
                    deadline = clock() + _NAMING_BUDGET
                elif clock() > deadline:
                    size.complete = False
                    return False
        return True

    walk(root, [])
    return size


def package_limit(environ: Mapping[str, str]) -> int:
    """Ray's package limit as Ray reads it (``RAY_max_grpc_message_size``, else ``PACKAGE_LIMIT``)."""
    try:
        return int(environ.get("RAY_max_grpc_message_size", PACKAGE_LIMIT))
    except ValueError:
        return PACKAGE_LIMIT


def check_working_dir(root: str, excludes: Sequence[str] = (), limit: int | None = None) -> PackageSize:
    """Size ``root`` as Ray would pack it; its size when it fits ``limit`` (default: Ray's, from this
    process's environment, which the driver's Ray reads too).

    Raises:
        SyncError: it does not fit, naming its biggest entries and how to leave them out.
    """
    limit = package_limit(os.environ) if limit is None else limit
    size = package_size(root, excludes, limit)
    if size.total <= limit:
        return size
    amount = _human(size.total) if size.complete else f"more than {_human(size.total)}"
    biggest = ", ".join(f"{name} {_human(nbytes)}" for name, nbytes in size.biggest())
    raise SyncError(
        f"Ray would upload the working directory {root} to every node, and it holds {amount} after .gitignore, "
        f".rayignore and --ray-exclude (Ray's package limit is {_human(limit)}); the biggest: {biggest}. Leave them out "
        "with --ray-exclude PATTERN or a .rayignore line, or run pslaunch from a directory holding only the code "
        "(keep data sets on storage every node reads)")


def _human(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"
