"""Pushes by invitation: a server lets at most ``PSLAUNCH_PUSH_WINDOW`` bytes of big pushes in at once.

A ``dist_sync`` round takes one push of every worker, and every worker sends its push as soon as it has
it: with N workers a value arrives N times at once. The round merges each push into one buffer as it
is read (``rounds``), but whatever ZeroMQ has received and the server's loop has not read yet is held
in full, a buffer per message: with 1,024 workers and a 1 MiB value, a GiB in one server.

So a worker whose part is big enough that the job's workers together could send more than the window
of it (``num_workers x bytes > window``, a rule every worker applies alike) first sends an *offer*: a
PUSH with ``FLAG_OFFER`` that names the part and its size, without the value. The server checks it,
queues it, and sends ``PUSH_INVITE`` while the invited bytes not merged yet stay within the window
(always one at least, so a part bigger than the window still goes); the worker then sends the push as
usual, which releases its bytes here once merged, and the next offers are invited. Offers are invited
in arrival order.

States of an offer: *queued* --invited (bytes admitted)--> *invited* --its push merged--> gone. A
worker that rejoins (a restart of the worker alone) takes its offers and admitted bytes with it.

Single-threaded: the server's loop calls everything here.
"""

from __future__ import annotations

from collections import deque
from typing import Callable

__all__ = ["Invitations"]

Invite = Callable[[int, int, int], None]
"""``invite(worker, req_id, index)``: send ``PUSH_INVITE`` for part ``index`` of push ``req_id`` of ``worker``."""


class Invitations:
    """The offers of one server and the bytes it admitted (see the module docstring)."""

    def __init__(self, window: int, invite: Invite) -> None:
        self.window = window if window > 0 else float("inf")  # 0: workers never offer, so any offer is let in
        self.invite = invite
        self.queued: deque[tuple[int, int, int, int]] = deque()  # (worker, req_id, index, nbytes), in arrival order
        self.invited: dict[tuple[int, int, int], int] = {}  # (worker, req_id, index) -> bytes admitted
        self.admitted = 0  # bytes invited whose push has not been merged yet
        self.peak = 0  # the most bytes admitted at once
        self.offers = 0  # offers taken

    def offer(self, worker: int, req_id: int, index: int, nbytes: int) -> None:
        """Take an offer (checked by the caller against the part it names); invite what fits now."""
        self.offers += 1
        self.queued.append((worker, req_id, index, nbytes))
        self._invite_what_fits()

    def arrived(self, worker: int, req_id: int, index: int) -> None:
        """A push came; if it was invited its bytes leave the window and more offers are invited."""
        nbytes = self.invited.pop((worker, req_id, index), None)
        if nbytes is not None:
            self.admitted -= nbytes
            if self.queued:
                self._invite_what_fits()

    def forget_worker(self, worker: int) -> None:
        """``worker`` was replaced by a restarted one: its offers and admitted bytes go with it."""
        self.queued = deque(o for o in self.queued if o[0] != worker)
        for slot in [s for s in self.invited if s[0] == worker]:
            self.admitted -= self.invited.pop(slot)
        self._invite_what_fits()

    def _invite_what_fits(self) -> None:
        queued = self.queued
        while queued and (self.admitted == 0 or self.admitted + queued[0][3] <= self.window):
            worker, req_id, index, nbytes = queued.popleft()
            self.invited[(worker, req_id, index)] = nbytes
            self.admitted += nbytes
            self.peak = max(self.peak, self.admitted)
            self.invite(worker, req_id, index)
