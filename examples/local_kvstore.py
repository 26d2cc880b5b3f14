"""A tour of the local KVStore: init, push (one value and per-device lists), pull, an updater, an optimizer.

Run: python examples/local_kvstore.py
"""

import numpy as np

import kvcore


def main() -> None:
    shape = (2, 3)
    kv = kvcore.create("local")
    kv.init(3, np.ones(shape, np.float32) * 2)
    out = np.zeros(shape, np.float32)
    kv.pull(3, out=out)
    print("after init with 2s:", out.ravel().tolist())

    kv.push(3, np.ones(shape, np.float32) * 8)
    kv.pull(3, out=out)
    print("after pushing 8s (default updater assigns):", out.ravel().tolist())

    devices = [np.ones(shape, np.float32), np.ones(shape, np.float32)]
    kv.push(3, devices)
    kv.pull(3, out=out)
    print("after pushing ones from 2 devices (summed):", out.ravel().tolist())

    kv.set_updater(lambda key, merged, stored: stored.__iadd__(merged * 2))
    kv.push(3, devices)
    kv.pull(3, out=out)
    print("after an updater stored += merged*2:", out.ravel().tolist())

    sgd = kvcore.create("local")
    sgd.set_optimizer(kvcore.optim.SGD(learning_rate=0.1, momentum=0.9))
    weight = np.zeros(4, np.float32)
    sgd.init("w", weight)
    for step in range(3):
        sgd.pushpull("w", np.ones(4, np.float32), out=weight)
        print(f"SGD step {step}: w = {weight.round(4).tolist()}")
    gpus = kvcore.num_gpus()
    print("array backend:", f"CuPy on {gpus} GPU(s)" if gpus else "numpy (no usable GPU)")


if __name__ == "__main__":
    main()
