"""A check of the distributed KVStore in the style of MXNet's tests/nightly/dist_sync_kvstore.py.

The script MXNet users know, ported to ``import kvcore``: the same calls (``kv.init``, ``kv.push``,
``kv.pull``, ``kv.row_sparse_pull``, ``kv.set_optimizer``, ``kv.rank``, ``kv.num_workers``) and the
same expected values. Start it for every role with the DMLC_* environment (docs/env.md), e.g.
with the launcher, or by hand::

    export DMLC_PS_ROOT_URI=127.0.0.1 DMLC_PS_ROOT_PORT=9091 DMLC_NUM_WORKER=2 DMLC_NUM_SERVER=1
    DMLC_ROLE=scheduler python examples/dist_kvstore_check.py &
    DMLC_ROLE=server python examples/dist_kvstore_check.py &
    python examples/dist_kvstore_check.py & python examples/dist_kvstore_check.py

The scheduler and server end inside ``import kvcore`` (MXNet's rule); each worker prints
``worker <rank>/<n>: all checks passed`` and exits 0.
"""

import numpy as np

import kvcore as mx_kv  # MXNet: import mxnet as mx; mx.kv

shape = (2, 3)
big_shape = (1200, 1200)  # split across the servers when PSLAUNCH_BIGARRAY_BOUND is below 1,440,000
keys = ["3", "5", "7"]
rsp_key = "9"
rate = 2  # rescale_grad of the Test optimizer: weight += rate * merged_gradient


def check_diff_to_scalar(array: np.ndarray, value: float, what: str) -> None:
    """Every element of ``array`` equals ``value`` (exact: these are small integers in float32)."""
    diff = np.abs(array - value)
    if diff.max() != 0:
        raise AssertionError(f"{what}: expected {value}, got values from {array.min()} to {array.max()}")


def init_kv():
    kv = mx_kv.create("dist_sync")
    kv.init(keys, [np.ones(shape, np.float32)] * len(keys))
    kv.init("99", np.ones(big_shape, np.float32))
    kv.init(rsp_key, np.ones(big_shape, np.float32))
    kv.set_optimizer(mx_kv.optim.create("test", rescale_grad=rate))
    return kv, kv.rank, kv.num_workers


def test_sync_push_pull(kv, my_rank: int, nworker: int) -> None:
    nrepeat = 3
    for _ in range(nrepeat):  # pushes of later rounds queue on the servers until each round closes
        kv.push("3", np.ones(shape, np.float32) * (my_rank + 1))
        kv.push("99", np.ones(big_shape, np.float32) * (my_rank + 1))
    num = (nworker + 1) * nworker * rate / 2 * nrepeat + 1
    val = np.zeros(shape, np.float32)
    kv.pull("3", out=val)
    check_diff_to_scalar(val, num, "key 3")
    val2 = np.zeros(big_shape, np.float32)
    kv.pull("99", out=val2)
    check_diff_to_scalar(val2, num, "key 99")


def test_list_push_pull(kv, my_rank: int, nworker: int) -> None:
    kv.push(keys, [np.ones(shape, np.float32) * (my_rank + 1)] * len(keys))
    outs = [np.zeros(shape, np.float32) for _ in keys]
    kv.pull(keys, out=outs)
    # key 3 went through test_sync_push_pull's 3 rounds first; 5 and 7 only through this one
    expected = {"3": (nworker + 1) * nworker * rate / 2 * 4 + 1, "5": (nworker + 1) * nworker * rate / 2 + 1}
    expected["7"] = expected["5"]
    for key, out in zip(keys, outs):
        check_diff_to_scalar(out, expected[key], f"key {key}")


def test_row_sparse_pull(kv, my_rank: int, nworker: int) -> None:
    kv.push(rsp_key, np.ones(big_shape, np.float32) * (my_rank + 1))
    row_ids = np.array([0, my_rank + 1, big_shape[0] - 1], dtype=np.int64)
    out = np.full(big_shape, -1, np.float32)
    kv.row_sparse_pull(rsp_key, out=out, row_ids=row_ids)
    num = (nworker + 1) * nworker * rate / 2 + 1
    check_diff_to_scalar(out[row_ids], num, "pulled rows")
    others = np.setdiff1d(np.arange(big_shape[0]), row_ids)
    check_diff_to_scalar(out[others], 0, "rows not asked for")


def main() -> None:
    kv, my_rank, nworker = init_kv()
    test_sync_push_pull(kv, my_rank, nworker)
    test_list_push_pull(kv, my_rank, nworker)
    test_row_sparse_pull(kv, my_rank, nworker)
    kv.barrier()
    print(f"worker {my_rank}/{nworker}: all checks passed", flush=True)


if __name__ == "__main__":
    main()
