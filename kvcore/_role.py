"""MXNet's rule for scripts started for every role: importing kvcore as a scheduler or server runs that node.

A launcher (or a hand-written script) may start the user's training script for every role with
``DMLC_ROLE`` set. When the role is ``scheduler`` or ``server``, ``import kvcore`` runs that node of
the job and ends the process when the job ends: exit code 0 when it ended in order, 1 when it
failed (the error is printed), 2 when the environment is malformed. An unset ``DMLC_ROLE`` means
worker: the import returns and the script goes on.

A process runs one node: when this process already runs one (``psnode.claimed_role()``; a server
imports kvcore while it unpickles an optimizer), the import starts nothing.
"""

from __future__ import annotations

import os
import sys

__all__ = ["run_role_if_asked", "take_job_key"]


def take_job_key() -> None:
    """Take the job key out of this process's environment (``psnode.transport.security.take_job_key``); a
    malformed key is reported when the node starts (``kvcore.create``), not at import."""
    from psnode.transport import security

    try:
        security.take_job_key()
    except security.EnvError:
        pass


def run_role_if_asked() -> None:
    """Run this process as the scheduler or a server when DMLC_ROLE says so, then exit."""
    role = os.environ.get("DMLC_ROLE", "").strip().lower()
    if role not in ("scheduler", "server"):
        return
    import psnode

    if psnode.claimed_role() is not None:
        return  # imported inside the node this process runs: nothing to start
    code = psnode.run_node(role)
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)  # end here: the user's script below the import is worker code
