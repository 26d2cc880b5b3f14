"""A job run in a real terminal (tmux), for the tests of pslaunch's live table: ``run_in_terminal``
starts a script in a fresh tmux server, waits for a pattern on the screen while it runs, then for the
script's ``EXIT=`` line, and takes the tmux server down."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

__all__ = ["run_in_terminal"]


def run_in_terminal(script: Path, socket_name: str, pattern: str, width: int = 160,
                    timeout: float = 60) -> tuple[re.Match | None, str]:
    """Run ``bash script`` (which ends with ``echo EXIT=$?``) in a tmux terminal of ``width`` columns;
    the first match of ``pattern`` on the screen (its whitespace folded) while the script runs, and
    the screen with its history once it printed ``EXIT=`` (or ``timeout`` seconds more passed)."""
    tmux = ["tmux", "-L", socket_name]
    subprocess.run([*tmux, "new-session", "-d", "-s", "job", "-x", str(width), "-y", "30", "bash --norc --noprofile"],
                   check=True, timeout=10)
    screen = ""
    try:
        subprocess.run([*tmux, "send-keys", "-t", "job", f"bash {script}", "Enter"], check=True, timeout=10)
        deadline = time.monotonic() + timeout
        seen = None
        while time.monotonic() < deadline and seen is None and "EXIT=" not in screen:
            screen = subprocess.run([*tmux, "capture-pane", "-p", "-t", "job"], capture_output=True, text=True,
                                    check=True, timeout=10).stdout
            seen = re.search(pattern, " ".join(screen.split()))
            time.sleep(0.3)
        while "EXIT=" not in screen and time.monotonic() < deadline + timeout:
            time.sleep(0.5)
            screen = subprocess.run([*tmux, "capture-pane", "-p", "-S", "-200", "-t", "job"], capture_output=True,
                                    text=True, check=True, timeout=10).stdout
        return seen, screen
    finally:
        subprocess.run([*tmux, "kill-server"], timeout=10)
