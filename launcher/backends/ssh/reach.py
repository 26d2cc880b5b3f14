"""Whether every host reaches the scheduler's address, checked before the job starts.

Over each host's pre-flight ssh connection, a tiny Python program on the host connects to the
scheduler's address and port, which a socket here holds open in the scheduler's place meanwhile;
every host that cannot is named with the address and why (``PreflightError``). The ssh and mpi
backends run it when the scheduler runs here at an address that is not a loopback one.
"""

from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from ...errors import PreflightError
from ...planning.network import loopback_name
from .connection import run_remote_output

__all__ = ["REACH_CHECK", "check_scheduler_reachable", "check_plan_reachable"]


#: What each host runs to connect to the scheduler's address (argv: address, port, timeout).
REACH_CHECK = (
    "import socket,sys\n"
    "try: socket.create_connection((sys.argv[1], int(sys.argv[2])), float(sys.argv[3])).close()\n"
    "except socket.timeout: sys.stderr.write('no answer within ' + sys.argv[3] + ' s'); sys.exit(1)\n"
    "except OSError as e: sys.stderr.write(e.strerror or str(e)); sys.exit(1)\n"
)


def check_scheduler_reachable(address: str, port: int, clients: dict, python: str, timeout: float,
                              note: Callable[[str], None] | None = None) -> None:
    """Check from every host in ``clients`` (``{Host: SSHClient}``) that ``address:port`` accepts a
    TCP connection, while a socket here listens there in the scheduler's place.

    A host without ``python`` is not checked (``note`` says so). Raises ``PreflightError`` with one
    line per host that cannot connect, naming it, the address and why.
    """
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((address, port))
        except OSError as exc:
            raise PreflightError(f"the scheduler cannot listen on {address}:{port} here: {exc.strerror or exc}") from exc
        listener.listen(128)  # the kernel completes the connections; nothing needs to accept them

        def one(item) -> str | None:
            host, client = item
            argv = [python, "-c", REACH_CHECK, address, str(port), f"{timeout:g}"]
            code, err = run_remote_output(client, argv, timeout + 5)
            if code in (126, 127):
                if note is not None:
                    note(f"{host.label}: cannot check that the scheduler at {address}:{port} is reachable: "
                         f"no {python} there")
                return None
            return None if code == 0 else f"{host.label} cannot reach the scheduler at {address}:{port}: {err or f'exit {code}'}"

        with ThreadPoolExecutor(max_workers=max(1, min(32, len(clients)))) as pool:
            problems = [p for p in pool.map(one, clients.items()) if p]
    if problems:
        raise PreflightError(
            f"{len(problems)} of {len(clients)} host(s) cannot reach the scheduler's address:\n  " + "\n  ".join(problems)
            + "\n  (the address this machine uses toward the hosts; set --interface NAME or --interface NETWORK "
            "to one every host reaches)")


def check_plan_reachable(plan, clients: dict, config, printer) -> None:
    """``check_scheduler_reachable`` for a plan whose scheduler runs on this machine at an address
    that is not a loopback one (else nothing to check). Raises ``PreflightError``."""
    scheduler = plan.by_role("scheduler")[0]
    if scheduler.host.name != "localhost" or not clients or loopback_name(plan.root_uri):
        return
    if config.verbose:
        printer.note(f"checking that {len(clients)} host(s) reach the scheduler at {plan.root_uri}:{plan.root_port}")
    check_scheduler_reachable(plan.root_uri, plan.root_port, clients, config.python, config.ssh.connect_timeout, printer.note)
