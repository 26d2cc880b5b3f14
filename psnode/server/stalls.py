"""Which ``dist_sync`` rounds of this server wait, and on whom: the server's part of the stall
inspector (``PSLAUNCH_STALL_WARN``, ``PSLAUNCH_STALL_TIMEOUT``: ``psnode.node.stalls``).

A round that has some of its pushes but not all, and took none for longer than a threshold, is
*stalled*: the ``StallWatch`` says so once per round and threshold, naming the key, the round, how
long it has waited, the workers that pushed and those it waits for (and their hosts), so that a job
started by hand says it in its log too. It looks every quarter of the smaller threshold (at least
every second), so a server with many keys spends a scan of them that often; the hot path records
nothing. Rounds stalled on the same workers are said in one line. A round that a finished worker
never pushed to is said elsewhere (``ServerStore.stuck``: its pulls fail). Single-threaded (the
server's loop).
"""

from __future__ import annotations

from typing import Any, Callable

from psnode.node.stalls import StallClock

__all__ = ["StallWatch"]


class StallWatch:
    """The open rounds seen at the last look, since when each stands still, and what was said."""

    def __init__(self, clock: StallClock) -> None:
        self.clock = clock
        self._next = 0.0
        self._seen: dict[int, tuple[int, int, float]] = {}  # key id -> (rounds closed, pushes in, since)
        self.stalled = 0  # rounds that are stalled now (a gauge for heartbeats)

    def look(self, now: float, shards: Any, num_workers: int, finished: dict[int, str],
             host_of: Callable[[int], str]) -> list[tuple[str, list[int], str, list[int], float, str]]:
        """The stalls due now, each ``(sentence, the workers it waits for, its level, the workers that
        pushed and wait on it, seconds it waited, what waits)`` (none between looks or with both
        thresholds 0)."""
        clock = self.clock
        if not clock.on or now < self._next:
            return []
        self._next = now + max(1.0, clock.least / 4)
        seen, stalled, open_rounds = {}, {}, set()
        self.stalled = 0
        for shard in shards:
            round_ = shard.round
            if not shard.sync or not 0 < round_.count < round_.quorum:
                continue
            state = (round_.closed, round_.count)
            before = self._seen.get(shard.key_id)
            since = before[2] if before is not None and before[:2] == state else now
            seen[shard.key_id] = (*state, since)
            open_rounds.add((shard.key_id, round_.closed))
            waited = now - since
            if waited < clock.least:
                continue
            waiting_for = tuple(w for w in range(num_workers) if w not in round_.pushed and w not in finished)
            if not waiting_for:
                continue
            self.stalled += 1
            level = clock.due((shard.key_id, round_.closed), waited)
            if level is not None:
                stalled.setdefault((level, waiting_for), []).append((shard, waited))
        self._seen = seen
        clock.forget(open_rounds)
        lines = []
        for (level, waiting_for), rounds in stalled.items():
            shard, waited = max(rounds, key=lambda item: item[1])
            keys = f"key {shard.user_key!r}" + (f" and {len(rounds) - 1} more" if len(rounds) > 1 else "")
            missing = ", ".join(f"worker {w} on {host_of(w)}" for w in waiting_for)
            came = sorted({w for shard, _ in rounds for w in shard.round.pushed if w not in finished})
            pushed = ", ".join(f"worker {w}" for w in sorted(shard.round.pushed))
            lines.append((f"stalled: round {shard.round.closed + 1} of {keys} has waited {waited:.0f} s "
                          f"({clock.setting(level)}) for {missing}; {pushed} pushed", list(waiting_for), level, came,
                          waited, f"round {shard.round.closed + 1} of {keys}"))
        return lines
