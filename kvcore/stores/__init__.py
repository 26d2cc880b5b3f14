"""The KVStores behind ``kvcore.create(name)``: internal to kvcore; users call ``kvcore.create``.

- ``registry``: stores by name (``create``, ``register_store``); the distributed ones are imported
  on first use.
- ``base``: ``KVStoreBase``, MXNet's KVStore API and the argument checks every store shares;
  ``keys`` turns its many call forms into one.
- ``local``: ``local`` and ``device``, in one process.
- ``distributed``: ``dist_sync``, ``dist_async``, ``dist_device_sync``, over psnode's servers; where their
  keys live: ``sharding`` (key ids, parts of big keys), ``placement`` (by bytes), ``key_init`` (worker
  0 places, every worker learns), ``deferred_init`` (worker 0's init calls gathered),
  ``placement_book`` (the decisions, in the scheduler's ledger).
- ``allreduce``: ``allreduce``, the workers summing among themselves without servers.

A new store subclasses ``KVStoreBase`` in a module here and is named in ``registry``.
"""
