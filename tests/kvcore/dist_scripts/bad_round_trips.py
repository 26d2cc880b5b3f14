"""Worker: one-frame round trips that the server must refuse (an unknown key, a wrong size, a
truncated frame) fail with errors naming the problem; a refused push never leaves later pulls
waiting for it; and the next rounds stay exact."""

import os

import numpy as np

from testkit import use_recording_transport

os.environ["PSLAUNCH_TRANSPORT"] = use_recording_transport()  # the zmq transport, noting what is sent

import kvcore  # noqa: E402
from psnode.errors import RemoteError  # noqa: E402
from psnode.node.protocol import Cmd, pack_push_pull

kv = kvcore.create("dist_sync")
assert kv.num_workers == 1
value, out = np.ones(4, np.float32), np.zeros(4, np.float32)
kv.init(3, value)
node = kv._worker
placed = kv.layout_for(3, value.shape, value.dtype)
server, key_id = placed.parts[0].server, placed.id
uid = node.servers[server].uid.encode()

transport = node.conn.transport
sent = transport.sent_cmds  # the command of every message this worker sends (the real socket still sends it)


def round_trip(key, push_value, pull_out):
    """push then pull of one part as kvcore's fast path issues them; both futures, and the commands sent."""
    for _ in range(3):  # let the network thread park, so the push waits for the pull (one frame)
        kv.push(3, value)
        kv.pull(3, out=out)
    sent.clear()
    push = node.push_part(server, key, push_value)
    pull = node.pull_part(server, key, pull_out)
    assert node.wait_for(pull, 30) and node.wait_for(push, 30)
    return push, pull, list(sent)


for key, push_value, pull_out, expected in [
    (0xDEAD, value, np.zeros(4, np.float32), "key id 0xdead was never initialised"),
    (key_id, np.ones(8, np.float32), np.zeros(8, np.float32), "a push of 32 bytes, but this server holds 16"),
]:
    paths = []
    for _ in range(5):  # a thread delayed past the hand-back sends the two on their own: both must fail alike
        push, pull, commands = round_trip(key, push_value, pull_out)
        paths.append(commands)
        for future in (push, pull):
            error = future.exception()
            assert isinstance(error, RemoteError) and expected in str(error), repr(error)
    assert [Cmd.PUSH_PULL] in paths, [[Cmd(c).name for c in p] for p in paths]

# a refused push on its own (the general PUSH message) still counts, so the next pull does not wait for it
sent.clear()
push = node.push_part(server, key_id, np.ones(8, np.float32))
assert node.wait_for(push, 30)
assert isinstance(push.exception(), RemoteError) and "a push of 32 bytes" in str(push.exception()), push.exception()
assert sent == [Cmd.PUSH], [Cmd(c).name for c in sent]
pulled = kv.pull(3, out=out, wait=False)
pulled.wait(30)

# a truncated frame is dropped by the server (counted as malformed); nothing answers it
transport.send(uid, [pack_push_pull(10**9, 10**9 + 1, key_id, 0, 1, value.tobytes())[:-3]])

for i in range(50):  # and the job goes on with exact values: one worker, so the pull is its own push
    kv.push(3, value * i)
    kv.pull(3, out=out)
    assert np.all(out == i), (i, out)
print("OK", kv.rank, flush=True)
