"""Checkpoints on disk, apart from the servers that write them.

- ``layout``: the files of a checkpoint directory, the manifest, and which checkpoint is the
  newest complete one.
- ``file_format``: one server's checkpoint file: its format, writing and syncing, and reading
  with every field checked.
"""
