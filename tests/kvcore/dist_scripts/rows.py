"""Worker: row_sparse_pull of a small key and of a key split across servers returns exactly the asked rows."""

import numpy as np

import kvcore

kv = kvcore.create("dist_sync")
rank, n = kv.rank, kv.num_workers
for key, shape in ((1, (6, 4)), (2, (1000, 300))):
    base = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    kv.init(key, base)
    kv.push(key, base * 0 + (rank + 1))
    rows = np.array([shape[0] - 1, 0, 3, 3], dtype=np.int64)
    dense = np.full(shape, -1, np.float32)
    kv.row_sparse_pull(key, out=dense, row_ids=rows)
    total = n * (n + 1) / 2
    expected = np.zeros(shape, np.float32)
    expected[[0, 3, shape[0] - 1]] = total
    assert np.array_equal(dense, expected), (key, dense[:4, :4])
    sparse = kvcore.RowSparseArray(shape, np.float32)
    kv.row_sparse_pull(key, out=sparse, row_ids=rows)
    assert sparse.indices.tolist() == [0, 3, shape[0] - 1], sparse.indices
    assert np.all(sparse.data == total)
kv.barrier()
print("OK", rank, flush=True)
