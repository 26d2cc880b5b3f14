"""Worker: several threads wait on their own pulls at once (one of them receives for all), and a done
callback that itself waits on another handle completes; every value is exact."""

import threading

import numpy as np

import kvcore

kv = kvcore.create("dist_sync")
rank, n = kv.rank, kv.num_workers
threads = 4
kv.init(list(range(threads + 1)), [np.zeros(3, np.float32) for _ in range(threads + 1)])
errors = []


def rounds(key: int) -> None:
    try:
        out = np.zeros(3, np.float32)
        for i in range(40):
            kv.push(key, np.full(3, rank + 1 + i, np.float32))
            kv.pull(key, out=out)
            expected = n * (n + 1) / 2 + n * i
            assert np.all(out == expected), (key, i, out, expected)
    except BaseException as exc:  # reported by the main thread
        errors.append(exc)


workers = [threading.Thread(target=rounds, args=(k,)) for k in range(threads)]
for t in workers:
    t.start()
for t in workers:
    t.join(60)
assert not any(t.is_alive() for t in workers), "a waiting thread never finished"
assert not errors, errors

# a callback that waits on another handle runs on the receiving thread: it must not deadlock
inner_out = np.zeros(3, np.float32)
kv.push(threads, np.ones(3, np.float32))
got = []
called = threading.Event()


def callback(done):
    got.append(kv.pull(threads, out=inner_out, wait=False).wait(30))
    called.set()


outer = kv.pull(0, out=np.zeros(3, np.float32), wait=False)
outer.add_done_callback(callback)
outer.wait(60)
assert called.wait(60), "the callback did not finish"
kv.barrier()
assert got == [None] and np.all(inner_out == n), (got, inner_out)
print("OK", rank, flush=True)
