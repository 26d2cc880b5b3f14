"""Which ``dist_sync`` rounds of this server wait, and on whom: the server's part of the stall
inspector (``PSLAUNCH_STALL_WARN``).

A round that has some of its pushes but not all, and took none for longer than the threshold, is
*stalled*: the ``StallWatch`` says so once per round, naming the key, the round, how long it has
waited, the workers that pushed and those it waits for (and their hosts), so that a job started by
hand says it in its log too. It looks every quarter of the threshold (at least every second), so a
server with many keys spends a scan of them that often; the hot path records nothing. Rounds stalled
on the same workers are said in one line. A round that a finished worker never pushed to is said
elsewhere (``ServerStore.stuck``: its pulls fail). Single-threaded (the server's loop).
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["StallWatch"]


class StallWatch:
    """The open rounds seen at the last look, since when each stands still, and what was said."""

    def __init__(self, threshold: float) -> None:
        self.threshold = threshold
        self._next = 0.0
        self._seen: dict[int, tuple[int, int, float]] = {}  # key id -> (rounds closed, pushes in, since)
        self._said: set[tuple[int, int]] = set()  # (key id, round) told once
        self.stalled = 0  # rounds that are stalled now (a gauge for heartbeats)

    def look(self, now: float, shards: Any, num_workers: int, finished: dict[int, str],
             host_of: Callable[[int], str]) -> list[tuple[str, list[int]]]:
        """The stalls due now, each ``(sentence, the workers it waits for)`` (none between looks or with
        the threshold 0)."""
        if self.threshold <= 0 or now < self._next:
            return []
        self._next = now + max(1.0, self.threshold / 4)
        seen, stalled = {}, {}
        for shard in shards:
            round_ = shard.round
            if not shard.sync or not 0 < round_.count < round_.quorum:
                continue
            state = (round_.closed, round_.count)
            before = self._seen.get(shard.key_id)
            since = before[2] if before is not None and before[:2] == state else now
            seen[shard.key_id] = (*state, since)
            waited = now - since
            if waited >= self.threshold:
                waiting_for = tuple(w for w in range(num_workers) if w not in round_.pushed and w not in finished)
                if waiting_for:
                    stalled.setdefault(waiting_for, []).append((shard, waited))
        self._seen = seen
        self.stalled = sum(len(v) for v in stalled.values())
        lines = []
        for waiting_for, rounds in stalled.items():
            new = [(shard, waited) for shard, waited in rounds if (shard.key_id, shard.round.closed) not in self._said]
            if not new:
                continue
            self._said.update((shard.key_id, shard.round.closed) for shard, _ in new)
            shard, waited = max(new, key=lambda item: item[1])
            keys = f"key {shard.user_key!r}" + (f" and {len(new) - 1} more" if len(new) > 1 else "")
            missing = ", ".join(f"worker {w} on {host_of(w)}" for w in waiting_for)
            pushed = ", ".join(f"worker {w}" for w in sorted(shard.round.pushed))
            lines.append((f"stalled: round {shard.round.closed + 1} of {keys} has waited {waited:.0f} s "
                          f"(PSLAUNCH_STALL_WARN={self.threshold:g}) for {missing}; {pushed} pushed", list(waiting_for)))
        return lines
