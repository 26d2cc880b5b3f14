"""Sum two keys across the devices of one process with the shared model (mshadow-ps's local_sum).

    python examples/local_sum.py 0 1 2

Each device id given runs in a thread of its own: it fills a (2, 3) array with row 0 = 1 and
row 1 = its device id, pushes each row as a key, asks for the results and waits for them. Afterwards
every device holds the sums: row 0 = the number of devices, row 1 = the sum of the ids. On a machine
with enough GPUs the ids are GPU numbers and the sums run on the GPUs; otherwise they name CPU slots.
"""

from __future__ import annotations

import sys
import threading

import numpy as np

import kvcore
from kvcore import arrays


def run_device(model: kvcore.SharedModel, devid: int, results: dict, lock: threading.Lock) -> None:
    device = model.device(devid)
    with arrays.device_context(device):
        data = arrays.zeros((2, 3), np.float32, device)
        data[0] = 1
        data[1] = devid
        with lock:
            print(f"dev{devid} ({device}): before sync\n{arrays.asnumpy(data)}", flush=True)
        model.init_key(data[0].shape, 0, devid)
        model.init_key(data[1].shape, 1, devid)
        # push each row, then ask for its sum; computation could run here meanwhile
        model.push(data[0], 0, devid)
        model.pull_req(data[0], 0, devid)
        model.push(data[1], 1, devid)
        model.pull_req(data[1], 1, devid)
        model.pull_wait(0, devid)
        model.pull_wait(1, devid)
        results[devid] = arrays.asnumpy(data).copy()
        with lock:
            print(f"dev{devid}: after sync\n{results[devid]}", flush=True)


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: local_sum.py DEVID [DEVID ...]   e.g. local_sum.py 0 1 2", file=sys.stderr)
        return 2
    devids = [int(a) for a in argv]
    results: dict[int, np.ndarray] = {}
    errors: list[BaseException] = []
    lock = threading.Lock()
    device = "auto"
    if arrays.gpu_available() and max(devids) >= arrays.num_gpus():
        print(f"note: {arrays.num_gpus()} GPU(s) here; device ids {devids} run on CPU slots", flush=True)
        device = "cpu"
    with kvcore.create_shared_model("local", device=device) as model:
        model.init(devids)

        def target(devid: int) -> None:
            try:
                run_device(model, devid, results, lock)
            except BaseException as exc:  # reported below, with the device it came from
                errors.append(exc)

        threads = [threading.Thread(target=target, args=(d,), name=f"dev{d}") for d in devids]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    if errors:
        print(f"error: {errors[0]}", file=sys.stderr)
        return 1
    expected = np.array([[len(devids)] * 3, [sum(devids)] * 3], np.float32)
    wrong = [d for d, r in results.items() if not np.array_equal(r, expected)]
    if wrong or len(results) != len(devids):
        print(f"error: devices {wrong} do not hold the expected sums {expected.tolist()}", file=sys.stderr)
        return 1
    print(f"ok: every device holds row 0 = {len(devids)} and row 1 = {sum(devids)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
