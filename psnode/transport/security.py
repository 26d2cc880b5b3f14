"""The job key and what it buys: authenticated connections, optional encryption, who may talk at all.

A job is keyed by a 32-byte secret (``PSLAUNCH_JOB_KEY``, 64 hex digits, or a mode-0600 file named
by ``PSLAUNCH_JOB_KEY_FILE``; docs/env.md). Under pslaunch it comes through an inherited pipe
instead (``PSLAUNCH_JOB_KEY_FD``: ``pscontract.hand_key_over``), so it is in no process's
environment. ``take_job_key`` reads it and removes the variable from ``os.environ``, so user code
and the processes it starts never see it.

With a key, every ZeroMQ connection proves that it knows it before ZeroMQ accepts a single message
from it (ZMTP's security handshake, checked by a ZAP handler running in every node):

- ``auth`` (the default with a key): the PLAIN mechanism, where the "password" is
  HMAC-SHA256(key, username) and the username is ``<job id>/<the peer's identity>``. The handler
  checks the HMAC and that the job is this one. The password does not reveal the key, but travels
  in the clear: on a network someone else can read, use ``curve``.
- ``curve`` (``PSLAUNCH_ENCRYPT=curve``): CurveZMQ, every message encrypted and authenticated. Both
  keypairs of the job (the servers' and the clients') are derived from the job key, so nothing but
  the key has to be distributed; the handler checks that a client's public key is the job's.

Either way only a holder of the key gets a connection, so the sender a ROUTER names (the routing
id of the connection) is a member of the job; which member is checked above the transport, against
the address book the scheduler sent (``membership``).

A connection that fails the handshake is closed by ZeroMQ before any frame of it is buffered. The
handler names what it refused (another job's node on this port, a wrong key) in the node's log.

Without a key the runtime runs unauthenticated, and only when every address a node binds or
connects to is a loopback address (``check_unkeyed``); it warns once.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
import socket
import threading
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from pscontract import JobKeyError
from pscontract import read_job_key as contract_read_job_key
from psnode.errors import EnvError
from psnode.log import logger

__all__ = [
    "JOB_KEY",
    "JOB_KEY_FD",
    "JOB_KEY_FILE",
    "ZAP_DOMAIN",
    "EnvError",
    "Security",
    "ZapHandler",
    "check_unkeyed",
    "read_job_key",
    "secure_or_loopback",
    "take_job_key",
    "taken_key",
]

JOB_KEY = "PSLAUNCH_JOB_KEY"
JOB_KEY_FILE = "PSLAUNCH_JOB_KEY_FILE"
JOB_KEY_FD = "PSLAUNCH_JOB_KEY_FD"
ZAP_DOMAIN = "pslaunch"


@dataclass(frozen=True)
class Security:
    """How one node's connections are secured: ``mode`` is ``none``, ``auth`` or ``curve``.

    ``key`` never appears in ``repr`` (nor anywhere else the project prints).
    """

    mode: str
    job_id: str
    key: bytes | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.mode not in ("none", "auth", "curve"):
            raise ValueError(f"security mode {self.mode!r} is not none, auth or curve")
        if (self.mode == "none") != (self.key is None):
            raise ValueError(f"security mode {self.mode!r} {'needs' if self.key is None else 'takes no'} job key")

    # ---- derived credentials -------------------------------------------------------------
    def _derive(self, label: str) -> bytes:
        assert self.key is not None
        return hmac.new(self.key, f"pslaunch|{label}".encode(), hashlib.sha256).digest()

    def lane_key(self) -> bytes:
        """The key a worker's lanes (``psnode.transport.lanes``) prove themselves with, derived from the job key;
        empty without one."""
        return self._derive("lanes") if self.key is not None else b""

    def username(self, identity: bytes) -> bytes:
        """The PLAIN username of ``identity``: ``<job id>/<identity>``."""
        return self.job_id.encode() + b"/" + identity

    def password(self, username: bytes) -> bytes:
        """The PLAIN password of ``username``: 64 hex digits of an HMAC under the key."""
        return hmac.new(self.key or b"", b"pslaunch-plain|" + username, hashlib.sha256).hexdigest().encode()

    def server_keys(self) -> tuple[bytes, bytes]:
        """The job's CURVE server keypair ``(public, secret)``, z85-encoded."""
        return _curve_pair(self._derive("curve-server"))

    def client_keys(self) -> tuple[bytes, bytes]:
        """The job's CURVE client keypair ``(public, secret)``, z85-encoded."""
        return _curve_pair(self._derive("curve-client"))


def _curve_pair(seed: bytes) -> tuple[bytes, bytes]:
    import zmq
    from zmq.utils import z85

    secret = z85.encode(seed)
    return zmq.curve_public(secret), secret


# ---- the key ---------------------------------------------------------------------------------
def read_job_key(environ: Mapping[str, str]) -> bytes | None:
    """The job key from ``PSLAUNCH_JOB_KEY``, the file ``PSLAUNCH_JOB_KEY_FILE`` names or the pipe
    ``PSLAUNCH_JOB_KEY_FD`` names, or None (``pscontract.read_job_key``, which the launcher's
    per-node agents read it with too).

    Raises:
        EnvError: a malformed key, two of the variables set, or a key file that is not a regular
            file of mode 0600 (or stricter) owned by this user. The message never contains the key.
    """
    try:
        return contract_read_job_key(environ)
    except JobKeyError as exc:
        raise EnvError(str(exc)) from None


_taken: list = []  # what this process took out of its environment: the key, None, or the EnvError


def take_job_key(environ: MutableMapping[str, str] | None = None) -> bytes | None:
    """Read the job key (``read_job_key``) and remove ``PSLAUNCH_JOB_KEY`` from ``environ``
    (``os.environ``), so that user code and its child processes never see it; this process keeps
    it for its node (``taken_key``). Taking it again once it is gone gives what was taken.

    Raises:
        EnvError: the key is malformed (it is removed all the same; ``taken_key`` raises it too).
    """
    env = os.environ if environ is None else environ
    if environ is None and _taken and JOB_KEY not in env and JOB_KEY_FILE not in env and JOB_KEY_FD not in env:
        return taken_key()
    error: EnvError | None = None
    key = None
    try:
        key = read_job_key(env)
    except EnvError as exc:
        error = exc
    finally:
        env.pop(JOB_KEY, None)
        env.pop(JOB_KEY_FD, None)  # read once: a child would find the pipe empty
    if environ is None:
        _taken[:] = [error if error is not None else key]
    if error is not None:
        raise error
    return key


def taken_key() -> bytes | None:
    """The key ``take_job_key`` took from this process's environment (None when it took none).

    Raises:
        EnvError: the key it took was malformed.
    """
    if not _taken:
        return None
    if isinstance(_taken[0], EnvError):
        raise _taken[0]
    return _taken[0]


_warned = threading.Event()


def check_unkeyed(addresses: Mapping[str, str]) -> None:
    """Without a key: allow only loopback addresses and warn once that the job is unauthenticated.

    ``addresses`` maps the variable that gives each address to the address (an IP).

    Raises:
        EnvError: an address is not loopback; the message names the variables.
    """
    remote = {name: addr for name, addr in addresses.items() if not _is_loopback(addr)}
    if remote:
        named = ", ".join(f"{name}={addr}" for name, addr in remote.items())
        raise EnvError(
            f"refusing to start without a job key on a non-loopback address ({named}): anyone who reaches "
            f"the port could join the job. pslaunch sets {JOB_KEY} for you; a job started by hand needs "
            f"{JOB_KEY} (64 hex digits) or {JOB_KEY_FILE} (a mode-0600 file) in every process"
        )
    if not _warned.is_set():
        _warned.set()
        if logger.handlers or logging.getLogger().handlers:
            logger.warning("psnode: no job key (%s): the job is unauthenticated; any local user can connect to it",
                           JOB_KEY)
        else:  # said once, plainly (without a handler the logging module would print the bare message too)
            import sys

            print(f"psnode: warning: no job key ({JOB_KEY}): this job is unauthenticated; any local user can "
                  "connect to it", file=sys.stderr, flush=True)


def secure_or_loopback(env: Any, addresses: Mapping[str, str]) -> None:
    """A node of ``env`` (a ``NodeEnv``) without a job key runs only where the scheduler's address
    and ``addresses`` (variable -> IP) are loopback: ``check_unkeyed``.

    Raises:
        EnvError: no key and a non-loopback address (the message names the variables).
    """
    if env.job_key is not None:
        return
    try:
        root = socket.gethostbyname(env.root_uri)
    except OSError as exc:
        raise EnvError(f"DMLC_PS_ROOT_URI={env.root_uri!r} does not resolve to an address: {exc}") from exc
    check_unkeyed({"DMLC_PS_ROOT_URI": root, **addresses})


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


# ---- the ZAP handler ---------------------------------------------------------------------------
class ZapHandler:
    """Checks every connection a ZeroMQ context accepts (ZAP, RFC 27), on a thread of its own.

    ``refused`` counts the connections it turned away.
    """

    def __init__(self, context, security: Security) -> None:
        import zmq

        self.security = security
        self.refused = 0
        self._socket = context.socket(zmq.REP)
        self._socket.linger = 0
        self._socket.bind("inproc://zeromq.zap.01")
        self._stop_reader, self._stop_writer = os.pipe()
        self._thread = threading.Thread(target=self._serve, name="psnode-zap", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._stop_reader, zmq.POLLIN)
        while True:
            try:
                ready = dict(poller.poll())
            except zmq.ZMQError:
                return
            if self._stop_reader in ready:
                return
            try:
                request = self._socket.recv_multipart()
            except zmq.ZMQError:
                return
            try:
                self._socket.send_multipart(self._answer(request))
            except zmq.ZMQError:
                return

    def _answer(self, request: list[bytes]) -> list[bytes]:
        """The ZAP reply to ``request``: 200 with the user id, or 400 naming why."""
        version, sequence = (request + [b"", b""])[:2]
        if len(request) < 6 or version != b"1.0":
            return [b"1.0", sequence, b"500", b"malformed ZAP request", b"", b""]
        _, _, domain, address, _, mechanism, *credentials = request
        ok, reason = self._check(domain, mechanism, credentials)
        if ok:
            return [b"1.0", sequence, b"200", b"OK", b"", b""]
        self.refused += 1
        logger.warning("psnode: refused a connection from %s: %s", address.decode(errors="replace"), reason)
        return [b"1.0", sequence, b"400", reason.encode()[:255], b"", b""]

    def _check(self, domain: bytes, mechanism: bytes, credentials: list[bytes]) -> tuple[bool, str]:
        sec = self.security
        if domain != ZAP_DOMAIN.encode():
            return False, f"ZAP domain {domain!r} is not {ZAP_DOMAIN!r}"
        if sec.mode == "auth":
            if mechanism != b"PLAIN" or len(credentials) != 2:
                return False, f"a {mechanism.decode(errors='replace')} handshake where this job wants PLAIN (its key)"
            username, password = credentials
            job = username.partition(b"/")[0]
            if job != sec.job_id.encode():
                return False, (f"a node of job {job.decode(errors='replace')!r} tried to join; this port belongs to "
                               f"job {sec.job_id!r}")
            if not hmac.compare_digest(password, sec.password(username)):
                return False, f"a node of job {sec.job_id!r} presented a wrong key"
            return True, ""
        if sec.mode == "curve":
            if mechanism != b"CURVE" or len(credentials) != 1:
                return False, f"a {mechanism.decode(errors='replace')} handshake where this job wants CURVE"
            from zmq.utils import z85

            if not hmac.compare_digest(z85.encode(credentials[0]), sec.client_keys()[0]):
                return False, f"a CURVE client whose key is not this job's ({sec.job_id!r})"
            return True, ""
        return True, ""

    def close(self) -> None:
        """Stop the handler thread and close its socket."""
        try:
            os.write(self._stop_writer, b"x")
        except OSError:
            pass
        self._thread.join(timeout=2.0)
        self._socket.close(0)
        for fd in (self._stop_reader, self._stop_writer):
            try:
                os.close(fd)
            except OSError:
                pass
