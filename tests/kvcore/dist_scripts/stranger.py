"""What a stranger sends to a node's port for lanes or streams (``psnode.transport.lanes``' handshake):
bytes that open nothing, then a handshake whose proof is not made with the job's key. The node must
close both without taking them (no acceptor's last word) and serve on."""

import os
import socket


def knock(host: str, port: int, acceptor: str, magic: bytes, unix: str = "") -> None:
    """Send ``acceptor`` at ``host:port`` (or at the abstract Unix socket ``unix``) a stranger's bytes
    and a forged handshake.

    Raises:
        AssertionError: the node took the forged connection.
    """
    with _connect(host, port, unix) as sock:
        sock.sendall(os.urandom(300))
    with _connect(host, port, unix) as sock:
        who = b"worker@stranger"
        sock.sendall(magic + len(who).to_bytes(2, "little") + who + len(acceptor).to_bytes(2, "little")
                     + acceptor.encode() + os.urandom(16))
        sock.settimeout(5)
        sock.recv(48)  # the node's nonce and proof
        sock.sendall(os.urandom(32))  # a proof without the key
        assert sock.recv(1) == b"", f"{acceptor} took a connection without the key's proof"  # closed, not taken


def _connect(host: str, port: int, unix: str) -> socket.socket:
    if not unix:
        return socket.create_connection((host, port), timeout=5)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5)
    sock.connect("\0" + unix)
    return sock
