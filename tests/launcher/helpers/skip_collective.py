"""Test helper: workers whose collectives differ, in a job without servers (``-s 0``).

Every worker allreduces key ``'a'``; then worker 0 allreduces ``'b'`` and ``'c'``, while worker 1
skips ``'b'`` and allreduces ``'c'``: each waits for the other forever (a skipped collective, the
deadlock it makes). With $SKIP unset the workers run the same collectives and finish. Prints
``OK <rank>``.
"""

import os

import numpy as np

from kvcore import collectives as C

value = np.ones(8, np.float32)
C.allreduce(value, key="a")
skip = os.environ.get("SKIP") == "1"
for key in ("b", "c"):
    if key == "b" and skip and C.rank() == 1:
        continue
    C.allreduce(value, key=key)
print("OK", C.rank())
