"""CPU binding (``--cpu-bind``, ``PSLAUNCH_CPU_BIND``): which cores a process of the job may run on.

The value names a share, computed where it is applied, from the cores that host lets the process use
(its affinity mask) and its NUMA nodes (``/sys/devices/system/node``):

* ``cores:I:N``: process I of the N the job runs on this host gets a contiguous block of the usable
  cores, the blocks as even as they can be (with more processes than cores, one core each, in turn);
* ``numa:I:N``: process I gets NUMA node I mod (the nodes it may use), all of that node's usable cores;
* ``list:0-3,8``: exactly these cores (what a spawner that bound the process already passes on).

``bind_self`` applies it to every thread of the calling process (threads started later inherit it):
the runtime calls it when a node starts, so a process started over ssh, or by hand, is bound too.
pslaunch's local spawner binds each child as soon as it starts (``os.sched_setaffinity``) and
passes the ``list:`` it chose. Pure functions but for those two; Linux only (elsewhere binding is a
no-op that says why).
"""

from __future__ import annotations

import glob
import os
from typing import Iterable, Sequence

__all__ = ["MODES", "parse", "share", "resolve", "numa_nodes", "cpu_list", "parse_list", "bind_self", "bind_pid"]

MODES = ("none", "cores", "numa")


def parse_list(text: str) -> set[int]:
    """``0-3,8`` -> {0, 1, 2, 3, 8} (the kernel's cpulist format). Raises ValueError naming ``text``."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        low, _, high = part.partition("-")
        try:
            first, last = int(low), int(high or low)
        except ValueError:
            raise ValueError(f"{text!r} is not a list of CPUs (like 0-3,8)") from None
        if first < 0 or last < first or last > 1 << 16:
            raise ValueError(f"{text!r} is not a list of CPUs (like 0-3,8)")
        cpus.update(range(first, last + 1))
    if not cpus:
        raise ValueError(f"{text!r} names no CPU")
    return cpus


def cpu_list(cpus: Iterable[int]) -> str:
    """{0, 1, 2, 3, 8} -> ``0-3,8``."""
    ranges: list[list[int]] = []
    for cpu in sorted(set(cpus)):
        if ranges and cpu == ranges[-1][1] + 1:
            ranges[-1][1] = cpu
        else:
            ranges.append([cpu, cpu])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in ranges)


def parse(value: str) -> tuple[str, int, int] | set[int]:
    """``cores:I:N`` / ``numa:I:N`` -> (mode, I, N); ``list:...`` -> the CPUs. Raises ValueError naming
    the value."""
    mode, _, rest = value.strip().partition(":")
    if mode == "list":
        return parse_list(rest)
    parts = rest.split(":")
    if mode not in ("cores", "numa") or len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise ValueError(f"PSLAUNCH_CPU_BIND={value!r} must be cores:I:N, numa:I:N or list:CPUS")
    index, count = int(parts[0]), int(parts[1])
    if not 0 <= index < count:
        raise ValueError(f"PSLAUNCH_CPU_BIND={value!r}: process {index} of {count} does not exist")
    return mode, index, count


def numa_nodes(root: str = "/sys/devices/system/node") -> list[set[int]]:
    """The CPUs of each NUMA node, in node order (one node of every CPU when ``root`` has none)."""
    nodes = []
    for path in sorted(glob.glob(os.path.join(root, "node[0-9]*", "cpulist")),
                       key=lambda p: int(os.path.basename(os.path.dirname(p))[4:])):
        try:
            with open(path) as fh:
                text = fh.read().strip()
        except OSError:
            continue
        if text:
            nodes.append(parse_list(text))
    return nodes


def share(mode: str, index: int, count: int, usable: Sequence[int], nodes: Sequence[set[int]] = ()) -> set[int]:
    """The CPUs of process ``index`` of ``count`` under ``mode``, out of ``usable`` (see the module)."""
    cpus = sorted(set(usable))
    if not cpus:
        raise ValueError("no usable CPU to share")
    if mode == "numa":
        mine = [node & set(cpus) for node in nodes]
        mine = [node for node in mine if node] or [set(cpus)]
        return mine[index % len(mine)]
    if count >= len(cpus):
        return {cpus[index % len(cpus)]}
    size, extra = divmod(len(cpus), count)
    start = index * size + min(index, extra)
    return set(cpus[start:start + size + (1 if index < extra else 0)])


def resolve(value: str, usable: Sequence[int] | None = None) -> set[int]:
    """The CPUs ``PSLAUNCH_CPU_BIND=value`` gives the calling process (its own mask when ``usable``
    is None). Raises ValueError naming the value."""
    parsed = parse(value)
    if isinstance(parsed, set):
        return parsed
    mode, index, count = parsed
    return share(mode, index, count, sorted(os.sched_getaffinity(0)) if usable is None else usable,
                 numa_nodes() if mode == "numa" else ())


def bind_pid(pid: int, cpus: set[int]) -> None:
    """Bind process ``pid``'s main thread (and the threads it starts from now on) to ``cpus``."""
    os.sched_setaffinity(pid, cpus)


def bind_self(cpus: set[int]) -> int:
    """Bind every thread of this process to ``cpus``; returns how many threads were bound."""
    bound = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
            bound += 1
        except (ProcessLookupError, ValueError):
            pass  # the thread ended meanwhile
    return bound
