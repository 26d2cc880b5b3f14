"""An elastic job's membership at the scheduler (``PSLAUNCH_MIN_WORKERS`` below ``DMLC_NUM_WORKER``).

A worker leaves at a step boundary (SIGTERM: a preempted pod, a spot notice), with every push it
made acknowledged. It asks the scheduler (``LEAVE``); the scheduler takes it out of the roster (so
barriers, the job's end and liveness count it no more), tells every server and worker
(``WORKER_LEFT``: each server's rounds after its last push close without it, exactly), answers any
barrier it was the last one missing, and then acknowledges, so the worker exits knowing everyone
heard. Ranks are not reused: the others keep theirs (``kv.rank`` is an id, ``kv.num_workers`` the
members now).

While fewer than ``PSLAUNCH_MIN_WORKERS`` remain, the job waits ``PSLAUNCH_ELASTIC_TIMEOUT``
seconds for more, and then fails, naming what it waited for (``ElasticError``). Single-threaded
(the scheduler's loop).
"""

from __future__ import annotations

import time
from typing import Any

from psnode.errors import PSNodeError
from psnode.log import logger
from psnode.node.protocol import FLAG_ERROR, GROUP_ROLES, Cmd, Group, pack_header, pack_json

__all__ = ["Elastic", "ElasticError"]


class ElasticError(PSNodeError):
    """An elastic job had fewer workers than its minimum for longer than its timeout."""


class Elastic:
    """The scheduler's part of an elastic job (see the module docstring)."""

    def __init__(self, env: Any) -> None:
        self.env = env
        self.left: dict[int, str] = {}  # rank -> description, of the workers that left
        self.short_since: float | None = None  # when the members fell below the minimum

    def leave(self, scheduler: Any, sender: bytes, member: Any, req_id: int) -> None:
        """``member`` asks to leave the job now (``LEAVE``)."""
        env, peer = self.env, member.peer
        if not env.elastic or peer.role != "worker" or member.finished:
            why = ("leaving needs an elastic job (-n MIN:MAX, PSLAUNCH_MIN_WORKERS)" if not env.elastic
                   else f"{peer.describe()} cannot leave: it is no worker, or it finished")
            scheduler.transport.send(sender, [pack_header(Cmd.LEAVE_ACK, req_id, flags=FLAG_ERROR),
                                              pack_json({"error": why})])
            return
        roster = scheduler.roster
        roster.leave(sender)
        scheduler.barriers.forget(sender)
        self.left[peer.rank] = peer.describe()
        remaining = roster.expected["worker"]
        note = pack_json({"rank": peer.rank, "node": peer.describe(), "workers": remaining})
        for uid in roster.of_roles(("server", "replica", "worker")):
            if not roster.members[uid].finished:
                try:
                    scheduler.transport.send(uid, [pack_header(Cmd.WORKER_LEFT), note])
                except PSNodeError:
                    pass  # gone: its own news
        scheduler.transport.send(sender, [pack_header(Cmd.LEAVE_ACK, req_id)])
        logger.warning("scheduler: %s left the job at a step boundary; %d %s on (minimum %d)",
                       peer.describe(), remaining, "worker goes" if remaining == 1 else "workers go", env.min_workers)
        self.complete_barriers(scheduler)
        if remaining < env.min_workers and self.short_since is None:
            self.short_since = time.monotonic()

    @staticmethod
    def complete_barriers(scheduler: Any) -> None:
        """Answer the open barriers every remaining member has reached (the one that left was the last
        one missing)."""
        for group in list(scheduler.barriers.waiting):
            done = scheduler.barriers.complete_if(group, scheduler.roster.size_of(GROUP_ROLES[Group(group)]))
            if done is not None:
                scheduler._barrier_done(group, *done)

    def check(self, workers: int) -> None:
        """Raise ``ElasticError`` once the job has had fewer than its minimum workers for longer than
        ``PSLAUNCH_ELASTIC_TIMEOUT``."""
        if self.short_since is None:
            return
        env = self.env
        if workers >= env.min_workers:
            self.short_since = None
            return
        waited = time.monotonic() - self.short_since
        if waited > env.elastic_timeout:
            gone = ", ".join(self.left.values())
            raise ElasticError(
                f"the job has {workers} worker{'' if workers == 1 else 's'}, fewer than its minimum of "
                f"{env.min_workers} (PSLAUNCH_MIN_WORKERS), and no worker came within {waited:.0f} s "
                f"(PSLAUNCH_ELASTIC_TIMEOUT={env.elastic_timeout:g}); left: {gone}")

