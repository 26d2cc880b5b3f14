"""The hostfile: one host per line, ``[user@]host[:sshport] [slots=N]``.

``#`` starts a comment, blank lines are skipped, an IPv6 address goes in brackets
(``[fe80::1]:2222``; a bare IPv6 address without a port is accepted too). A host may appear on
several lines; its slots add up. Every error names the file, the line number, the text and what
was expected. ``Host`` itself is the configuration's (``launcher.config``).
"""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path

from ..config import LOCAL_HOST, Host
from ..errors import HostfileError

__all__ = ["Host", "parse_hostfile", "parse_hostfile_text", "parse_address", "fail", "LOCAL_HOST"]

_HOSTNAME = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?$")
_USER = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
_EXPECTED = "expected '[user@]host[:sshport] [slots=N]'"


_BAD_SHOWN = 20  # malformed lines one error names


def fail(source: str, lineno: int, text: str, why: str) -> HostfileError:
    return HostfileError(f"{source}:{lineno}: {text.strip()!r}: {why}")


def parse_address(source: str, lineno: int, raw: str, token: str, number: str = "ssh port",
                   expected: str = _EXPECTED) -> tuple[str | None, str, int | None]:
    """``(user, host, the number after ':')`` of ``[user@]host[:number]``; ``number`` names it in errors."""
    user = None
    if "@" in token:
        user, _, token = token.rpartition("@")
        if not _USER.match(user):
            raise fail(source, lineno, raw, f"user {user!r} is not a valid user name; {expected}")
    port_text = None
    if token.startswith("["):
        close = token.find("]")
        if close < 0:
            raise fail(source, lineno, raw, f"'[' without ']' around an IPv6 address; {expected}")
        host, rest = token[1:close], token[close + 1 :]
        if rest:
            if not rest.startswith(":"):
                raise fail(source, lineno, raw, f"unexpected {rest!r} after ']'; {expected}")
            port_text = rest[1:]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise fail(source, lineno, raw, f"{host!r} in brackets is not an IPv6 address") from None
    elif token.count(":") > 1:
        try:
            ipaddress.IPv6Address(token)
        except ValueError:
            raise fail(
                source, lineno, raw, f"{token!r} is not an IPv6 address; write [addr]:port for a port"
            ) from None
        host = token
    else:
        host, sep, port_text = token.partition(":")
        if not sep:
            port_text = None
        if not _HOSTNAME.match(host):
            raise fail(source, lineno, raw, f"{host!r} is not a host name or address; {expected}")
    port = None
    if port_text is not None:
        if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
            raise fail(source, lineno, raw, f"{number} {port_text!r} is not a number in 1..65535")
        port = int(port_text)
    return user, host, port


def parse_hostfile_text(text: str, source: str = "<hostfile>") -> list[Host]:
    """Parse hostfile ``text``; ``source`` names it in errors. Returns the hosts in file order.

    Lines naming the same (user, host, port) are merged and their slots added. Raises
    ``HostfileError`` naming every malformed line (the first 20), or for a file without any host.
    """
    hosts: dict[tuple[str | None, str, int | None], Host] = {}
    bad: list[str] = []  # every malformed line is named, not just the first
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            user, host, port, slots = _parse_line(source, lineno, raw, line)
        except HostfileError as exc:
            bad.append(str(exc))
            continue
        key = (user, host, port)
        if key in hosts:
            old = hosts[key]
            merged = None if old.slots is None or slots is None else old.slots + slots
            hosts[key] = Host(host, user, port, merged, old.where)
        else:
            hosts[key] = Host(host, user, port, slots, f"{source}:{lineno}")
    if len(bad) == 1:
        raise HostfileError(bad[0])
    if bad:
        shown = bad[:_BAD_SHOWN] + ([f"and {len(bad) - _BAD_SHOWN} more"] if len(bad) > _BAD_SHOWN else [])
        raise HostfileError(f"{source}: {len(bad)} malformed lines: " + "; ".join(shown))
    if not hosts:
        raise HostfileError(f"{source}: no hosts in the file ({_EXPECTED}, one per line)")
    return list(hosts.values())


def _parse_line(source: str, lineno: int, raw: str, line: str) -> tuple[str | None, str, int | None, int | None]:
    """``(user, host, port, slots)`` of one hostfile line (comments stripped). Raises ``HostfileError``."""
    tokens = line.split()
    user, host, port = parse_address(source, lineno, raw, tokens[0])
    slots = None
    for extra in tokens[1:]:
        key, sep, value = extra.partition("=")
        if key not in ("slots", "max_slots") or not sep:
            raise fail(source, lineno, raw, f"unexpected {extra!r}; {_EXPECTED}")
        if not value.isdigit() or int(value) < 1:
            raise fail(source, lineno, raw, f"slots must be a whole number >= 1, got {value!r}")
        if slots is not None:
            raise fail(source, lineno, raw, "slots given twice")
        slots = int(value)
    return user, host, port, slots


def parse_hostfile(path: str | Path) -> list[Host]:
    """Read and parse the hostfile at ``path``. Raises ``HostfileError`` (also when unreadable)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise HostfileError(f"cannot read hostfile {str(path)!r}: {exc}") from exc
    return parse_hostfile_text(text, source=str(path))
