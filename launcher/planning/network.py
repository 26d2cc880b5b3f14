"""Addresses on a real cluster: the scheduler's address and ports, and what ``--interface`` means.

* ``--interface`` is one interface name (``eth0``), a comma-separated list tried in order
  (``ib0,eth0``), or an IPv4 network (``10.1.0.0/16``): the address of the first listed interface
  a host has, or its address inside the network. Each node resolves it on its own host
  (``DMLC_INTERFACE``, docs/env.md), so hosts whose interface names differ can share one job.
* The scheduler's address (``DMLC_PS_ROOT_URI``) when it runs here: the source address of the
  kernel's route toward each remote host in hostfile order, by the host's real name (ssh config's
  ``HostName``), until one is not a loopback address; else ``--interface`` resolved on this machine
  (hosts behind a bastion may have no route from here). Only the nodes' way to the scheduler uses
  it: the scheduler reaches the nodes at the addresses they advertise. A loopback address is never
  used when a host is remote: without a usable address the launch stops at once with an error
  naming what was tried and this machine's addresses.
Whether every host reaches the scheduler's address before the job starts is a check over ssh: the
ssh backends make it (``launcher.backends.ssh.reach``).
"""

from __future__ import annotations

import ipaddress
import random
import socket
from dataclasses import replace
from typing import Callable, Iterable

from pscontract import interface_address, interface_addresses, parse_interface_spec

from ..config import LaunchConfig, free_port
from ..errors import ConfigError
from .hostfile import LOCAL_HOST
from .plan import first_worker_host, torch_master_address

__all__ = ["parse_interface", "route_source", "choose_scheduler_address", "resolve", "loopback_name"]

def parse_interface(text: str) -> list[str] | ipaddress.IPv4Network:
    """``--interface``'s value, parsed by the contract's one parser (interface names tried in order,
    or an IPv4 network). Raises ``ConfigError`` naming the value and what is wrong with it."""
    try:
        return parse_interface_spec(text)
    except ValueError as exc:
        raise ConfigError(f"--interface {text!r} {exc}") from None


def route_source(address: str) -> str | None:
    """The local address the kernel would use to reach ``address`` (no packet is sent), or None."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            sock.connect((address, 9))
            return sock.getsockname()[0]
    except OSError:
        return None


def _resolve(name: str) -> tuple[str | None, str]:
    """The first IPv4 address of ``name`` (or IPv6 when it has none), and a failure reason."""
    try:
        infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    except OSError as exc:
        return None, f"unknown name ({exc.strerror or exc})"
    infos.sort(key=lambda info: info[0] != socket.AF_INET)
    return (infos[0][4][0], "") if infos else (None, "no address")


def _loopback(address: str) -> bool:
    return ipaddress.ip_address(address).is_loopback


def choose_scheduler_address(hosts: Iterable[tuple[str, str]], interface: str | None,
                             addresses: Callable[[], dict[str, str]] = interface_addresses,
                             where: dict[str, str | None] | None = None) -> tuple[str, bool]:
    """The address the scheduler has when it runs here, and whether any host is remote.

    ``hosts``: ``(label, real name)`` of every host of the hostfile in order, the real name being
    what ssh connects to (``HostName``). ``interface``: ``--interface``'s value. ``where``: each
    label's hostfile line (``FILE:LINE``), for errors. Raises ``ConfigError`` when a host is remote
    and no address but a loopback one can be found, naming what was tried and this machine's
    addresses; when that is so because a host's name does not resolve, the error names that host
    and its hostfile line first.
    """
    tried: list[str] = []
    unknown: list[str] = []
    remote = False
    chosen: str | None = None
    for label, name in hosts:
        address, why = _resolve(name)
        shown = label if name == label else f"{label} ({name})"
        if address is None:
            tried.append(f"{shown}: {why}")
            line = (where or {}).get(label)
            unknown.append(f"{line + ': ' if line else ''}host {shown} does not resolve on this machine: {why}")
            remote = True  # a name this machine cannot resolve is not this machine (it may be a proxy's)
            continue
        if _loopback(address):
            continue
        remote = True
        if chosen is None:
            source = route_source(address)
            if source is None:
                tried.append(f"{shown} = {address}: no route from this machine")
            elif _loopback(source):
                tried.append(f"{shown} = {address}: reached through loopback {source}")
            else:
                chosen = source
    if not remote:
        return "127.0.0.1", False
    if chosen is not None:
        return chosen, True
    here = addresses()
    if interface:
        picked = interface_address(parse_interface(interface), here)
        if picked is not None and not _loopback(picked):
            return picked, True
        tried.append(f"--interface {interface}: " + ("a loopback address here" if picked else "no match here"))
    listed = ", ".join(f"{n} {a}" for n, a in here.items() if not _loopback(a)) or "none"
    if unknown and not interface:
        raise ConfigError(f"{unknown[0]}; fix the name, or, for a host that ssh reaches through a proxy, give "
                          "--scheduler-host HOST or --interface NAME")
    raise ConfigError(
        "cannot choose the scheduler's address: a host is remote, and a loopback address would send every node "
        f"to its own machine. Tried: {'; '.join(tried) or 'nothing'}. This machine's addresses: {listed}. "
        "Set --interface NAME or --interface NETWORK (e.g. 10.1.0.0/16), or --scheduler-host HOST")


def loopback_name(name: str) -> bool:
    """Whether ``name`` is ``localhost`` or a loopback address."""
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return name == "localhost"


def resolve(config: LaunchConfig, real_names: list[tuple[str, str]] | None = None) -> LaunchConfig:
    """Fill in what needs a look at this machine; returns a new config.

    * ``launch_address``: the address every node dials for the scheduler. ``127.0.0.1`` for the local
      backend or when every host is this machine; the real name of ``--scheduler-host``; otherwise
      the address other hosts reach this machine at (``launcher.planning.network``: ``--interface`` here, or
      the route toward the hosts' real names), never a loopback address.
      ``real_names``: ``(label, name to reach it by)`` per host (and ``--scheduler-host``): what
      the ssh backends read from the ssh config (``HostName``); the names as given when None.
    * ``scheduler_port``: a free port here when the scheduler runs on this machine and none was
      given; 9091 (the DMLC tracker's default) when it runs on ``--scheduler-host``.

    Raises ``ConfigError`` for a malformed ``--interface``, one that matches nothing here when every
    process runs here, and when no address but a loopback one can be found for remote hosts.
    """
    address = config.launch_address
    spec = parse_interface(config.interface) if config.interface else None
    remote = False
    if config.hosts:  # the local backend refuses -H
        if real_names is None:  # the names as given (the ssh backends pass what their ssh config makes of them)
            real_names = [(host.name, host.name) for host in config.hosts]
            real_names += [(config.scheduler_host, config.scheduler_host)] if config.scheduler_host else []
        if config.scheduler_host:  # the name every node dials: what ssh reaches it by
            address = dict(real_names).get(config.scheduler_host, config.scheduler_host)
        else:
            address, remote = choose_scheduler_address(real_names, config.interface,
                                                       where={h.label: h.where for h in config.hosts})
    if spec is not None and not remote and not config.scheduler_host:
        here = interface_addresses()
        if interface_address(spec, here) is None:  # every process runs here: it must match here
            known = ", ".join(f"{n} {a}" for n, a in here.items())
            raise ConfigError(f"--interface {config.interface}: nothing here matches it (interfaces: {known})")
    port = config.scheduler_port
    if port is None:
        port = 9091 if config.scheduler_host else free_port(address if loopback_name(address) else "0.0.0.0")
    resolved = replace(config, launch_address=address, scheduler_port=port)
    if config.master_port is None:
        resolved = replace(resolved, master_port=_torch_master_port(resolved))
    return resolved


def _torch_master_port(config: LaunchConfig) -> int:
    """torch's ``MASTER_PORT`` (every worker gets it, whatever ``-s``): free on worker 0's host when that is this
    machine (a loopback address of it, or the launch address); on another host, where pslaunch
    cannot probe, a random port below Linux's ephemeral range (32768), which that host's kernel
    never hands to an outgoing connection."""
    host = first_worker_host(config)
    address = torch_master_address(config, host)
    if host is LOCAL_HOST or host.is_loopback:
        return free_port(address if loopback_name(address) else "0.0.0.0")  # else: the launch address, all interfaces
    return random.randrange(16384, 32768)
