"""A server: holds shards of the job's keys, merges pushes into rounds and answers pulls.

- ``node``: decodes workers' requests, runs them on the store and replies (``ServerNode``).
- ``store``: the server's keys: shards, their rounds and the updater (``ServerStore``).
- ``rounds``: the round machine (how pushes of one value are merged, when a pull sees it).
- ``groups``: many small keys pushed together, handled as one flat value.
- ``replies``: pull replies gathered per batch, push acknowledgements held to ride along.
- ``shard_memory``: where shards live (host memory or a GPU).
- ``checkpoints``: the server's part in checkpoints (write, commit, restore, re-shard).
- ``background``: work handed to a thread of its own (the checkpoints' disk writes).
"""
