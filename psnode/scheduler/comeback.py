"""A scheduler started again in place takes the running job back: the ``Comeback`` of its nodes.

Under ``PSLAUNCH_RESTART_SCOPE=worker`` pslaunch starts a scheduler that died again alone. The job's
servers and workers notice its connection end and register again with their ranks
(``SchedulerLink._rejoin``): a server adds the workers that finished meanwhile, each node the
barriers it saw complete. The comeback gathers what they say, and is over once every server rank and
every worker rank is back (a finished worker counts), plus a moment for the replicas, which no rank
lists. A part of ``scheduler.Scheduler``, which reads the messages and answers; it sends nothing.

A node may come without a rank: the scheduler before sent the address books and died before this
node's reached it (its process took the queued message with it). Such a node registers as at the
start; it gets the rank the other nodes' books give it: a worker its ``DMLC_WORKER_ID``, servers the
ranks not back yet in the order of their (host, port), as ``Roster.assign_ranks`` gave them
(``hold_unranked``, ``rank_unranked``). It then gets its address book, not ``SCHEDULER_BACK``.
"""

from __future__ import annotations

from typing import Any

from psnode.node.protocol import pack_json
from psnode.scheduler.roster import Barriers, Member, Roster

__all__ = ["Comeback", "SETTLE"]

#: Seconds the comeback waits, once every rank is back, for replicas (``PSLAUNCH_SERVER_REPLICAS``).
SETTLE = 0.5


class Comeback:
    """What the job's nodes said as they came back, and whether every rank is there."""

    def __init__(self) -> None:
        self.finished: dict[int, str] = {}  # workers that finished the job before (rank -> description)
        self.unranked: dict[bytes, dict] = {}  # nodes that came without a rank: their registrations
        self.ranked: set[bytes] = set()  # those given their rank here: they get an address book
        self.completed: dict[int, int] = {}  # barriers completed per group, the most any node saw
        self._settle_until: float | None = None

    def take(self, roster: Roster, sender: bytes, info: dict) -> Member | None:
        """Take a node back from its registration ``info`` (``rejoin``); its member (None: known already).

        Raises:
            ProtocolError, PSNodeError: see ``Roster.take_back``. KeyError, TypeError, ValueError,
                AttributeError: a malformed ``finished`` or ``barriers`` (nothing is taken).
        """
        finished = {int(rank): str(node)[:200] for rank, node in (info.get("finished") or {}).items()}
        completed = {int(group): int(count) for group, count in (info.get("barriers") or {}).items()}
        member = roster.take_back(sender, info)
        self.finished.update(finished)
        for group, count in completed.items():
            self.completed[group] = max(count, self.completed.get(group, 0))
        return member

    def hold_unranked(self, roster: Roster, sender: bytes, info: dict) -> None:
        """Keep the registration of a node without a rank until its rank can be told (``rank_unranked``)."""
        if sender not in roster.members:
            self.unranked[sender] = info

    def rank_unranked(self, roster: Roster) -> list[tuple[bytes, Member]]:
        """Give the nodes held without a rank the ranks the others' books give them, where that is
        known now; their new members."""
        taken = []
        missing = set(roster.missing_ranks(self.finished))
        for sender, info in list(self.unranked.items()):
            worker_id = info.get("worker_id")
            if info.get("role") == "worker" and type(worker_id) is int and f"worker {worker_id}" in missing:
                taken.append((sender, {**info, "rank": worker_id}))
                missing.discard(f"worker {worker_id}")
        servers = sorted((s, i) for s, i in self.unranked.items() if i.get("role") == "server")
        free = sorted(int(m.split()[1]) for m in missing if m.startswith("server "))
        if servers and len(servers) == len(free):  # all of them came: the order of (host, port) is theirs
            ordered = sorted(servers, key=lambda item: (str(item[1].get("host")), int(item[1].get("port") or 0)))
            taken += [(sender, {**info, "rank": rank}) for (sender, info), rank in zip(ordered, free)]
        members = []
        for sender, info in taken:
            del self.unranked[sender]
            member = roster.take_back(sender, info)
            if member is not None:
                self.ranked.add(sender)
                members.append((sender, member))
        return members

    def missing(self, roster: Roster) -> list[str]:
        """The ranks not back yet (``server 1``, ``worker 0``)."""
        return roster.missing_ranks(self.finished)

    def over(self, roster: Roster, now: float) -> bool:
        """True once every rank is back and ``SETTLE`` seconds passed since."""
        if self.missing(roster):
            self._settle_until = None
            return False
        self._settle_until = self._settle_until or now + SETTLE
        return now >= self._settle_until

    def close(self, roster: Roster, barriers: Barriers) -> None:
        """The job as it was: place-holders for the finished workers that left, the barriers' counts."""
        roster.add_finished(self.finished)
        barriers.completed.update(self.completed)


def back_body(completed: dict[int, Any]) -> bytes:
    """The ``SCHEDULER_BACK`` body: the barriers completed per group."""
    return pack_json({"barriers": {str(g): n for g, n in completed.items()}})
