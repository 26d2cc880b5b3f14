"""The scheduler's barriers as messages: who arrives, the answers, and the barriers that cannot end.

``Barriers`` (``psnode.scheduler.roster``) counts who arrived in which group; the ``BarrierDesk`` reads a
member's ``BARRIER`` message (its note, its number under ``PSLAUNCH_RESTART_SCOPE=worker``), answers
every waiter once the group is complete (``BARRIER_DONE``, with the notes), fails a barrier a finished
member can never reach instead of leaving its waiters hanging, and says of a barrier that waits past
``PSLAUNCH_STALL_WARN`` whom it waits for (``psnode.node.stalls``), ending the job past
``PSLAUNCH_STALL_TIMEOUT``. The scheduler owns the desk and hands it the messages; an elastic job's
leaver completes what it was the last one missing (``Elastic.complete_barriers``). Single-threaded, as
the scheduler.
"""

from __future__ import annotations

import time
from typing import Any

from psnode.env import NodeEnv
from psnode.errors import ProtocolError, PSNodeError
from psnode.node.protocol import FLAG_ERROR, GROUP_ROLES, Cmd, Group, pack_header, pack_json, unpack_json
from psnode.node.stalls import StallClock, say_stall
from psnode.scheduler.roster import Barriers, Member, Roster
from psnode.transport.base import Transport

__all__ = ["BarrierDesk"]

_NOTE_LIMIT = 256 << 10  # bytes of JSON a member's barrier note may take: worker 0's key placement (kvcore.stores.placement) rides in one


class BarrierDesk:
    """The barriers of one job's scheduler (see the module docstring): ``barriers`` its state, the
    scheduler's ``transport``, ``roster`` and ``job_report`` (``JobReport``: arrivals and completions on
    the timeline) the parts it speaks through."""

    def __init__(self, env: NodeEnv, transport: Transport, roster: Roster, job_report: Any) -> None:
        self.env = env
        self.transport = transport
        self.roster = roster
        self.job_report = job_report
        self.barriers = Barriers()
        self.stall_clock = StallClock.of(env)  # barriers that wait, said in the log (psnode.node.stalls)

    def arrive(self, sender: bytes, member: Member, req_id: int, group: int, frames: list) -> None:
        """Count ``sender`` in ``group``'s barrier; answer everyone once every member arrived."""
        error = None
        note = None
        number = 0  # a worker's barriers are numbered under PSLAUNCH_RESTART_SCOPE=worker
        if len(frames) > 1:
            if len(frames[1].buffer) > _NOTE_LIMIT:
                error = f"a barrier note of {len(frames[1].buffer)} bytes; notes take at most {_NOTE_LIMIT}"
            else:
                try:
                    body = unpack_json(frames[1])
                    note = body.get("note") if isinstance(body, dict) else None
                    n = body.get("n") if isinstance(body, dict) else None
                    number = n if type(n) is int and 0 < n < 1 << 62 else 0
                except ProtocolError as exc:
                    error = f"a malformed barrier note: {exc}"
        if error is None and group not in GROUP_ROLES:
            error = f"unknown barrier group {group}; the groups are " + ", ".join(f"{g.name.lower()} ({int(g)})" for g in Group)
        elif error is None and member.peer.role not in GROUP_ROLES[Group(group)]:
            error = f"{member.peer.describe()} is not in the barrier group {Group(group).name.lower()}"
        if error is not None:
            self.transport.send(sender, [pack_header(Cmd.BARRIER_DONE, req_id, flags=FLAG_ERROR), pack_json({"error": error})])
            return
        numbered = number and self.env.restart_scope == "worker"
        if numbered:
            replayed = self.barriers.replayed(group, number)
            if replayed is not None:  # a replacement redoing a barrier its predecessor passed
                self.transport.send(sender, [pack_header(Cmd.BARRIER_DONE, req_id), pack_json(
                    {"notes": replayed, "group": group, "completed": self.barriers.completed.get(group, 0)})])
                return
        self.job_report.barrier_arrived(group)
        done = self.barriers.arrive(group, sender, req_id, self.roster.size_of(GROUP_ROLES[Group(group)]), note)
        if done is None:
            if self.roster.any_finished:  # only a finished member can block a barrier for good
                self.fail_blocked()
            return
        self.answer(group, *done)

    def answer(self, group: int, waiters: list[tuple[bytes, int]], notes: list) -> None:
        """Answer every member waiting in ``group``'s barrier, which just completed."""
        self.job_report.barrier_done(group)
        if self.env.restart_scope == "worker":  # how many are complete: a replacement learns what it redoes
            body = [pack_json({"notes": notes, "group": group, "completed": self.barriers.completed.get(group, 0)})]
        else:
            body = [pack_json({"notes": notes})] if notes else []
        for uid, rid in waiters:
            self.transport.send(uid, [pack_header(Cmd.BARRIER_DONE, rid), *body])

    def fail_blocked(self) -> None:
        """A barrier that waits for a finished node can never complete: say so instead of hanging."""
        members = self.roster.members
        for group, waiting in list(self.barriers.waiting.items()):
            arrived = self.barriers.arrived.get(group, set())
            gone = [members[u].peer for u in self.roster.of_roles(GROUP_ROLES[Group(group)])
                    if u not in arrived and members[u].finished]
            if not gone:
                continue
            message = f"barrier of {Group(group).name.lower()} can never complete: {', '.join(p.describe() for p in gone)} already finished"
            for uid, rid in waiting:
                self.transport.send(uid, [pack_header(Cmd.BARRIER_DONE, rid, flags=FLAG_ERROR), pack_json({"error": message})])
            self.barriers.drop(group)
            self.barriers.notes.pop(group, None)

    def say_stalls(self) -> None:
        """Say once of each barrier that waited ``PSLAUNCH_STALL_WARN`` seconds whom it waits for, and
        once more past ``PSLAUNCH_STALL_TIMEOUT`` (``psnode.node.stalls``)."""
        now, clock = time.monotonic(), self.stall_clock
        numbers = {group: self.barriers.completed.get(group, 0) + 1 for group in self.barriers.opened}
        clock.forget(set(numbers.items()))
        for group, since in list(self.barriers.opened.items()):
            number = numbers[group]
            if now - since < clock.least:
                continue
            arrived = self.barriers.arrived.get(group, set())
            members = [m for uid, m in self.roster.members.items() if m.peer.role in GROUP_ROLES[Group(group)]]
            missing = [m.peer for uid, m in self.roster.members.items()
                       if m.peer.role in GROUP_ROLES[Group(group)] and uid not in arrived and not m.finished]
            level = clock.due((group, number), now - since) if missing else None
            if level is None:
                continue
            came = sorted(f"{m.peer.role} {m.peer.rank}" for uid, m in self.roster.members.items() if uid in arrived)
            waits = ", ".join(f"{p.role} {p.rank} on {p.host}" for p in sorted(missing, key=lambda p: (p.role, p.rank)))
            text = (f"stalled: barrier {number} of the {Group(group).name.lower()} has waited {now - since:.0f} s "
                    f"({clock.setting(level)}) for {waits}; {len(came)} of {len(members)} arrived "
                    f"({', '.join(came) or 'none'})")
            workers = sorted(p.rank for p in missing if p.role == "worker")
            error = say_stall(self.env, "scheduler", text, workers, level, self.job_report.timeline, now - since,
                              f"barrier {number} of the {Group(group).name.lower()}")
            for uid in arrived:  # the nodes that wait say it in their logs too
                try:
                    self.transport.send(uid, [pack_header(Cmd.BARRIER_STALLED), pack_json({"text": text})])
                except PSNodeError:  # gone: its own news
                    pass
            if error is not None:  # a job started by hand: every node hears why it ends
                body = {"message": str(error), "role": "scheduler", "rank": 0, "host": self.env.root_uri}
                for uid, member in self.roster.members.items():
                    if not member.finished:
                        try:
                            self.transport.send(uid, [pack_header(Cmd.NODE_DIED), pack_json(body)])
                        except PSNodeError:
                            pass
                raise error
