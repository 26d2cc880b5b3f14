"""Where an elastic job's capacity comes from (``-n MIN:MAX``): the hosts it may use now, with slots.

Two sources, each read again while the job runs (``launcher.supervision.elastic``):

* **the hostfile** (``-H``), read again whenever its contents change (``HostfileCapacity``);
* **a discovery script** (``--host-discovery-script``, Horovod's convention): a program that prints
  one host per line, ``host:slots`` (``host`` alone is one slot; ``user@host:slots``;
  ``[v6addr]:slots``), run with a time limit each time (``DiscoveryScript``).

``read()`` returns the hosts with their slots (every one has ``slots``), or raises ``CapacityError``
naming what is wrong: a bad line (its number and text), a script that failed (its exit code and the
last line it wrote to stderr) or ran past ``SCRIPT_TIMEOUT``. The job keeps its last view then.
Both sources are this module's only reads of the outside world; the decisions are the supervisor's.
"""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

from ..config import Host
from ..errors import HostfileError, LaunchError
from .hostfile import fail, parse_address, parse_hostfile_text

__all__ = ["Capacity", "CapacityError", "DiscoveryScript", "HostfileCapacity", "parse_discovered", "SCRIPT_TIMEOUT",
           "machine_of"]

_DISCOVERED = "expected '[user@]host[:slots]' (Horovod's discovery format)"

#: Seconds a discovery script may run before its answer is given up (the job keeps its last view).
SCRIPT_TIMEOUT = 10.0


class CapacityError(LaunchError):
    """The capacity source could not be read: a bad line, a failed script, a script past its time."""


def machine_of(host: Host) -> tuple:
    """What tells two hosts apart whatever their slots: ``(user, name, ssh port)``."""
    return (host.user, host.name, host.port)


def parse_discovered(text: str, source: str) -> list[Host]:
    """The hosts a discovery script printed (``host:slots`` per line, see the module docstring); a host
    named twice has its slots added. Raises ``HostfileError`` naming each bad line."""
    hosts: dict[tuple, Host] = {}
    bad = []
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if len(line.split()) != 1:
            bad.append(str(fail(source, lineno, raw, _DISCOVERED)))
            continue
        try:
            user, name, slots = parse_address(source, lineno, raw, line, "slots", _DISCOVERED)
        except HostfileError as exc:
            bad.append(str(exc))
            continue
        key = (user, name, None)
        old = hosts.get(key)
        hosts[key] = Host(name, user, None, (slots or 1) + (old.slots if old else 0), f"{source}:{lineno}")
    if bad:
        raise HostfileError("; ".join(bad[:20]) + (f"; and {len(bad) - 20} more" if len(bad) > 20 else ""))
    return list(hosts.values())


class Capacity:
    """A source of capacity; ``read()`` gives the hosts now (see the module docstring)."""

    describe = "capacity"

    def read(self) -> list[Host]:  # pragma: no cover - an interface
        raise NotImplementedError


class HostfileCapacity(Capacity):
    """The hostfile at ``path``, parsed again when its bytes change (``changed()`` says whether)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.describe = f"the hostfile {path}"
        self._digest: bytes | None = None

    def read(self) -> list[Host]:
        try:
            data = Path(self.path).read_bytes()
        except OSError as exc:
            raise CapacityError(f"cannot read the hostfile {self.path!r}: {exc}") from exc
        self._digest = hashlib.sha256(data).digest()
        try:
            return parse_hostfile_text(data.decode("utf-8", errors="replace"), source=self.path)
        except HostfileError as exc:
            raise CapacityError(str(exc)) from None

    def changed(self) -> bool:
        """True when the file's bytes differ from those read last (or it cannot be read now)."""
        try:
            return hashlib.sha256(Path(self.path).read_bytes()).digest() != self._digest
        except OSError:
            return True


class DiscoveryScript(Capacity):
    """``--host-discovery-script``: run ``command`` (a path, no shell), read its ``host:slots`` lines."""

    def __init__(self, command: str, timeout: float = SCRIPT_TIMEOUT) -> None:
        self.command = command
        self.timeout = timeout
        self.describe = f"--host-discovery-script {command}"

    def read(self) -> list[Host]:
        try:
            done = subprocess.run([self.command], capture_output=True, timeout=self.timeout, check=False)
        except subprocess.TimeoutExpired:
            raise CapacityError(f"{self.describe} ran longer than {self.timeout:g} s") from None
        except OSError as exc:
            raise CapacityError(f"{self.describe} could not run: {exc}") from None
        if done.returncode != 0:
            last = (done.stderr.decode(errors="replace").strip().splitlines() or ["(nothing on stderr)"])[-1]
            raise CapacityError(f"{self.describe} failed with exit code {done.returncode}: {last[:300]}")
        try:
            return parse_discovered(done.stdout.decode(errors="replace"), self.describe)
        except HostfileError as exc:
            raise CapacityError(str(exc)) from None

    def changed(self) -> bool:
        """A script is asked every time."""
        return True
