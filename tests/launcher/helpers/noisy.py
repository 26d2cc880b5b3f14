"""Test helper: output that is hard to prefix — a line in two writes, bad UTF-8, a \\r progress bar."""

import sys
import time

out = sys.stdout.buffer
out.write(b"first half ")
out.flush()
time.sleep(0.2)
out.write(b"second half\n")
out.write(b"bad \xff\xfe bytes\n")
for pct in (10, 50, 100):
    out.write(f"progress {pct}%\r".encode())
    out.flush()
out.write(b"\n")
out.write(b"no newline at the end")
out.flush()
