"""Whether pslaunch holds its terminal: job control (Ctrl-Z) and the live table ask.

A shell gives the terminal to one process group at a time, the foreground job. pslaunch stops itself
with SIGTSTP only there (elsewhere the kernel would discard it), and the live table moves the cursor
only there: once the shell has the terminal back, the lines below the table are the shell's.
"""

from __future__ import annotations

import os

__all__ = ["in_foreground"]


def in_foreground(fd: int | None = None) -> bool | None:
    """Whether this process's group is the foreground job of the terminal ``fd`` (the controlling
    terminal when None); None when there is no such terminal to ask."""
    opened = None
    if fd is None:
        try:
            fd = opened = os.open("/dev/tty", os.O_RDONLY | os.O_NOCTTY)
        except OSError:
            return None
    try:
        return os.tcgetpgrp(fd) == os.getpgrp()
    except OSError:
        return None
    finally:
        if opened is not None:
            os.close(opened)
