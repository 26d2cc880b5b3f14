"""An elastic job's capacity while it runs (``-n MIN:MAX`` over ssh): workers start on slots that appear
and leave hosts that go.

Every ``INTERVAL`` seconds the job's capacity source is read (``launcher.planning.capacity``: the
hostfile again when it changed, or the discovery script). Against the workers running now:

* **a slot appears** (a new host, or more slots on one): while the job has fewer than MAX workers,
  pslaunch starts one there (``joiner_spec``: the lowest rank no running worker holds, as
  ``DMLC_WORKER_ID``); its runtime joins the running job (``psnode.scheduler.elastic``);
* **a host goes** (or has fewer slots): its workers beyond its slots get SIGTERM, the notice to leave
  at their next step boundary (``kvcore.leaving``); they exit 0 and are no failure. A worker that
  left frees its slot and its rank; pslaunch starts another in its place only when capacity is
  reported again (the slot is still listed).

Once a worker finished its part the job is ending: no worker joins or is told to leave any more. A
source that cannot be read (a bad line, a failing script) is said once per distinct error and the
job keeps its last view. Owned by the supervisor's loop (one thread); ``start`` is the supervisor's
seam that starts one process (the backend's launch, the table, the observer).
"""

from __future__ import annotations

import signal
import time
from typing import TYPE_CHECKING, Callable

from ..config import LaunchConfig
from ..planning.capacity import Capacity, CapacityError, DiscoveryScript, HostfileCapacity, machine_of
from ..planning.hostfile import Host
from ..planning.plan import Plan, ProcessSpec, joiner_spec

if TYPE_CHECKING:
    from ..backends.base import ProcessHandle

__all__ = ["ElasticCapacity", "INTERVAL", "capacity_of"]

#: Seconds between two reads of the capacity source (Horovod asks its discovery script every second).
INTERVAL = 1.0


def capacity_of(config: LaunchConfig) -> Capacity | None:
    """The capacity source of an elastic job, or None: a discovery script, else the hostfile over ssh."""
    if not config.elastic or config.backend != "ssh":
        return None
    if config.host_discovery_script:
        return DiscoveryScript(config.host_discovery_script)
    return HostfileCapacity(config.hostfile) if config.hostfile else None


class ElasticCapacity:
    """Grows and shrinks one job's workers with its capacity (see the module docstring)."""

    def __init__(self, config: LaunchConfig, source: Capacity, note: Callable[[str], None],
                 start: Callable[[ProcessSpec], "ProcessHandle"]) -> None:
        self.config = config
        self.source = source
        self.note = note
        self.start = start
        self.next_read = time.monotonic() + INTERVAL
        self.hosts: list[Host] = list(config.hosts)  # the capacity as last read
        self.told: set[int] = set()  # ids of the workers sent SIGTERM because their host went
        self._error: str | None = None  # the last error said (said again only when it changes)

    def step(self, handles: list["ProcessHandle"], plan: Plan, now: float) -> None:
        """Read the capacity when due and act on it (see the module docstring)."""
        if now < self.next_read:
            return
        self.next_read = now + INTERVAL
        if isinstance(self.source, HostfileCapacity) and not self.source.changed():
            hosts = self.hosts
        else:
            try:
                hosts = self.source.read()
                self._error = None
            except CapacityError as exc:
                if str(exc) != self._error:
                    self._error = str(exc)
                    self.note(f"{exc}; the job keeps the hosts it had")
                return
        self.hosts = hosts
        if any(h.spec.role == "worker" and (h.finished_at is not None or (h.status is not None and h.status.ok
                                                                           and h.left_at is None))
               for h in handles):
            return  # a worker finished its part: the job is ending, no worker joins or is told to leave now
        workers = [h for h in handles if h.spec.role == "worker" and h.status is None and h.left_at is None]
        self._shrink(workers)
        self._grow(workers, plan)

    def _shrink(self, workers: list["ProcessHandle"]) -> None:
        slots = {machine_of(h): h.slots for h in self.hosts}
        kept: dict[tuple, int] = {}
        for worker in sorted(workers, key=lambda w: w.spec.rank):
            if id(worker) in self.told:
                continue
            machine = machine_of(worker.spec.host)
            listed = machine in slots
            allowed = slots.get(machine)  # None: listed without slots=, any number
            used = kept.get(machine, 0)
            if not listed or (allowed is not None and used >= allowed):
                self.told.add(id(worker))
                gone = "is no longer listed" if not listed else f"has {allowed} slot{'s' if allowed != 1 else ''} now"
                self.note(f"{worker.spec.host.label} {gone} ({self.source.describe}): {worker.spec.name} leaves the "
                          "job at its next step boundary (SIGTERM)")
                worker.signal_process(signal.SIGTERM)
            else:
                kept[machine] = used + 1

    def _grow(self, workers: list["ProcessHandle"], plan: Plan) -> None:
        staying = [w for w in workers if id(w) not in self.told]
        used: dict[tuple, int] = {}
        for worker in staying:
            used[machine_of(worker.spec.host)] = used.get(machine_of(worker.spec.host), 0) + 1
        held = {w.spec.rank for w in workers}  # a leaver's rank is free once it left
        count = len(workers)  # a leaver is a member until it left: the runtime would refuse one more
        for host in self.hosts:
            free = (host.slots or 0) - used.get(machine_of(host), 0)
            while free > 0 and count < self.config.num_workers:
                rank = next(r for r in range(self.config.num_workers) if r not in held)
                local = used.get(machine_of(host), 0)
                spec = joiner_spec(self.config, plan, host, rank, local, host.slots or local + 1)
                self.note(f"{host.label} has a free slot ({self.source.describe}): starting {spec.name} to join "
                          f"the job ({count + 1} of at most {self.config.num_workers} workers)")
                self.start(spec)
                held.add(rank)
                used[machine_of(host)] = local + 1
                count += 1
                free -= 1
