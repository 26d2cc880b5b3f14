"""A replica that joins the running job (``--server-replicas``) gets its server's keys, at both ends.

On the server: the scheduler says a replica of its rank joins (``REPLICA_JOINING``); every worker then
marks the point in its stream to this server from which the replica gets its copies (``SEAM``), and
once every worker that has not finished did, the server sends what it holds (``SNAPSHOT``,
``psnode.server.snapshot``): its keys, worker 0's updater as it came and its state, the codecs'
parameters. On the replica: the copies that come before the keys are kept, and replayed in order once
the keys are taken; a replica named to take its server's place before the keys came has nothing to
serve and ends. Single-threaded (the server's loop).
"""

from __future__ import annotations

from typing import Any, Callable

from psnode.env import MARKER_CAUGHT_UP, MARKER_RESUMED
from psnode.errors import ProtocolError, PSNodeError, RequestRefused
from psnode.log import logger
from psnode.node.membership import PeerInfo, endpoint_of
from psnode.node.protocol import Cmd, pack_header, pack_json, unpack_json
from psnode.node.stats import stderr_line
from psnode.server.snapshot import read_snapshot, snapshot_frames

__all__ = ["Seeding"]


class Seeding:
    """One server's or replica's part in seeding a replica (see the module docstring).

    ``mirrored(peer, cmd, flags, req_id, frames)`` serves a worker's copy that waited for the keys.
    ``updater_blob`` and ``codec_params`` are what the server keeps to send: worker 0's updater as it
    came, and each configured codec's parameters (the server sets them as they come).
    """

    def __init__(self, server: Any, mirrored: Callable[..., None]) -> None:
        self.server = server
        self.mirrored = mirrored
        self.joining: dict[str, PeerInfo] = {}  # the server: replicas joining, by uid
        self.seams: dict[str, set[int]] = {}  # the server: the workers that marked each one's seam
        self.updater_blob: bytes | None = None
        self.codec_params: dict[int, dict] = {}
        self.seeded = False  # the replica: it took its server's keys
        self._before_seed: list[tuple] = []  # the replica: copies that came before its keys

    def replica_joining(self, cmd: int, peer: PeerInfo) -> None:
        """The scheduler says ``peer`` joins as a replica of this server (``REPLICA_JOINING``)."""
        server = self.server
        if cmd != Cmd.REPLICA_JOINING or peer.role != "replica" or peer.rank != server.rank:
            raise ProtocolError(f"a {Cmd(cmd).name} of {peer.describe()} to server {server.rank}")
        conn = server.conn
        conn.transport.connect(peer.uid.encode(), endpoint_of(peer, conn.transport, conn.me.fingerprint,
                                                             conn.env.same_host))
        self.joining[peer.uid] = peer
        self.send_keys(peer.uid)

    def seam(self, peer: PeerInfo, frames: list) -> None:
        """Worker ``peer`` marked where a joining replica's copies begin (``SEAM``)."""
        body = unpack_json(frames[1]) if len(frames) > 1 else None
        replica = body.get("replica") if isinstance(body, dict) else None
        if not isinstance(replica, str) or len(replica) > 300:
            raise ProtocolError(f"a SEAM naming {str(replica)[:80]!r}, not a replica")
        self.seams.setdefault(replica, set()).add(peer.rank)
        self.send_keys(replica)

    def hold_copy(self, copy: tuple) -> bool:
        """A late replica keeps a worker's copy ``(peer, cmd, flags, req_id, frames)`` that came before its
        server's keys (True); False: serve it now."""
        if self.server.conn.members.late and not self.seeded:
            self._before_seed.append(copy)
            return True
        return False

    def server_lost(self, rank: int, lost: str, by: str | None) -> None:
        """A server or replica of the job is lost (``SERVER_LOST``). This replica, named to take the
        place of its server before that server's keys came to it, has nothing to serve: it ends, and
        the job with it unless another replica of that rank is left."""
        conn = self.server.conn
        conn.transport.disconnect(lost.encode())
        self.joining.pop(lost, None)
        if by == conn.me.uid and conn.members.late and not self.seeded:
            conn.failure.fail(PSNodeError(
                f"replica of server {rank} was to serve in that server's place, but the server was lost before it "
                "sent this replica its keys"))

    def worker_finished(self) -> None:
        """A finished worker marks no seam (it sends nothing more): the replicas waiting for it need not."""
        for replica in list(self.joining):
            self.send_keys(replica)

    def send_keys(self, replica: str) -> None:
        """Send a joining replica this server's keys once every worker that has not finished marked where
        its copies begin: what this server holds then is what came before those points."""
        server = self.server
        peer = self.joining.get(replica)
        seamed = self.seams.get(replica, set())
        finished = server.store.finished
        if peer is None or not all(w in seamed or w in finished for w in range(server.conn.env.num_workers)):
            return
        del self.joining[replica]
        self.seams.pop(replica, None)
        header = pack_header(Cmd.SNAPSHOT)
        try:
            state = server.checkpoints.updater_state() if server.store.updater is not None else None
            frames = snapshot_frames(server.store, self.updater_blob, state, self.codec_params)
        except RequestRefused as exc:  # an optimizer whose state cannot be sent: the replica ends, naming it
            frames = [pack_json({"v": 1, "error": f"server {server.rank} cannot send its keys: {exc}"})]
        server.conn.transport.send(replica.encode(), [header, *frames])
        logger.info("server %d sent its %d keys to the replica %s that joins the job", server.rank,
                    len(server.store.shards), replica)

    def take_snapshot(self, frames: list) -> None:
        """This late replica's server sent its keys: take them, then the copies that came after them,
        in order. One that cannot be taken ends this replica (its server goes on without it)."""
        if self.seeded:
            raise ProtocolError("a second SNAPSHOT for a replica that has its keys")
        server = self.server
        store = server.store
        try:
            head = unpack_json(frames[0]) if frames else None
            if isinstance(head, dict) and head.get("error"):
                raise ProtocolError(str(head["error"])[:500])
            snap = read_snapshot(frames, server.conn.env.num_workers, store.memory, store.replay)
            for shard in snap.shards:
                store.shards[shard.key_id] = shard
                store.held_bytes += shard.nbytes
                store.kept_bytes += shard.nbytes * len(shard.history)
            if snap.updater_blob is not None:  # announced to the keys above, then given their state
                server.install_updater(snap.updater_blob)
                store.take_restored_state(snap.state)
        except (ProtocolError, RequestRefused) as exc:
            server.conn.failure.fail(ProtocolError(f"replica of server {server.rank}: the server's keys cannot be "
                                                   f"taken: {exc}"))
            return
        for worker, mark in snap.marks:
            store.marks.add(worker, mark)
        store.finished.update(snap.finished)
        for codec, params in snap.codecs:
            server.configure_codec(codec, params)
        self.seeded = True
        logger.warning("replica of server %d took that server's %d keys (%d copies came meanwhile): the server's "
                       "rank has this replica again", server.rank, len(snap.shards), len(self._before_seed))
        if server.conn.env.supervised:  # pslaunch's replacement record: it holds its server's keys from now on
            stderr_line(f"{MARKER_RESUMED} {{\"mark\": null, \"scalars\": null}}")
            stderr_line(MARKER_CAUGHT_UP)
        waiting, self._before_seed = self._before_seed, []
        for peer, cmd, flags, req_id, copy in waiting:
            self.mirrored(peer, cmd, flags, req_id, copy)
