"""Test helper: prints a line, then sleeps for argv[1] seconds (argv may carry a unique marker)."""

import sys
import time

print("sleeping", flush=True)
time.sleep(float(sys.argv[1]))
