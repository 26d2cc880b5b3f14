"""Checks every backend makes before anything starts (``--dry-run`` too):

* ``script``: the user's script exists where it will run (here, or on each host over ssh);
* ``checkpoint_dir``: every server host reaches ``--checkpoint-dir`` and can write it.
"""
