"""The parameters ``set_param`` accepts, parsed into one dataclass.

Names follow mshadow-ps where it had them (``update_on_server``, ``push_op[KEY]``,
``push_thread``, ``pull_thread``); values may be given as strings, as mshadow-ps took them, or as
Python values.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Hashable

from .errors import ConfigError

__all__ = ["SharedModelConfig", "PUSH_OPS", "PARAM_NAMES"]

PUSH_OPS = ("sum", "gather")
_THREAD_MODES = ("ndev", "one")
_DEVICE_MODES = ("auto", "cpu", "gpu")
_NCCL_MODES = ("auto", "on", "off")

PARAM_NAMES = (
    "update_on_server",
    "push_op[KEY]",
    "push_thread",
    "pull_thread",
    "timeout",
    "device",
    "nccl",
    "store",
)
"""Every name ``set_param`` accepts (``push_op[KEY]`` stands for one per key)."""

_PUSH_OP = re.compile(r"^push_op\[(.+)\]$")


@dataclass
class SharedModelConfig:
    """What ``set_param`` configured.

    Attributes:
        update_on_server: 1: pushes are gradients that an updater applies (in the process for
            'local', on the servers for 'dist') and pulls return weights; 0: pulls return the sum
            (or gather) of the pushes. None: the default of the model kind (0 local, 1 dist).
        push_ops: per key, how Level 1 combines the devices' pushes: 'sum' (default) or 'gather'.
        push_thread / pull_thread: 'ndev' (a thread per device, the default) or 'one' (a single
            thread for every device).
        timeout: seconds pull_wait (and other waits) give up after when nothing completes.
        device: 'auto' (GPUs when CuPy sees one, else CPU slots), 'cpu' or 'gpu'.
        nccl: 'auto' (NCCL for several GPUs when usable), 'on' (required) or 'off'.
        store: the distributed KVStore type 'dist' uses (``kvcore.create(store)``).
    """

    update_on_server: int | None = None
    push_ops: dict[Hashable, str] = field(default_factory=dict)
    push_thread: str = "ndev"
    pull_thread: str = "ndev"
    timeout: float = 120.0
    device: str = "auto"
    nccl: str = "auto"
    store: str = "dist_async"

    def apply(self, name: str, value: Any) -> None:
        """Set one parameter from its mshadow-ps name.

        Raises:
            ConfigError: unknown name, or a value that is not accepted (the message lists the
                accepted ones).
        """
        if not isinstance(name, str):
            raise ConfigError(f"parameter names are strings, got {name!r}")
        match = _PUSH_OP.match(name.strip())
        if match:
            self.push_ops[_parse_key(match.group(1))] = _choice(name, value, PUSH_OPS)
            return
        name = name.strip()
        if name == "update_on_server":
            self.update_on_server = _flag(name, value)
        elif name in ("push_thread", "pull_thread"):
            setattr(self, name, _choice(name, value, _THREAD_MODES))
        elif name == "timeout":
            self.timeout = _positive_float(name, value)
        elif name == "device":
            self.device = _choice(name, value, _DEVICE_MODES)
        elif name == "nccl":
            self.nccl = _choice(name, value, _NCCL_MODES)
        elif name == "store":
            if not isinstance(value, str) or not value.startswith("dist"):
                raise ConfigError(f"parameter 'store' must name a distributed KVStore such as 'dist_async', got {value!r}")
            self.store = value
        else:
            raise ConfigError(f"unknown shared-model parameter {name!r}; known parameters: {', '.join(PARAM_NAMES)}")

    def push_op(self, key: Hashable) -> str:
        """How Level 1 combines the pushes of ``key``."""
        return self.push_ops.get(key, "sum")


def _parse_key(text: str) -> Hashable:
    text = text.strip()
    try:
        return int(text)
    except ValueError:
        return text.strip("'\"")


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> str:
    text = str(value).strip().lower()
    if text not in allowed:
        raise ConfigError(f"parameter {name!r} must be one of {', '.join(allowed)}; got {value!r}")
    return text


def _flag(name: str, value: Any) -> int:
    text = str(value).strip().lower()
    if text in ("1", "true", "yes"):
        return 1
    if text in ("0", "false", "no"):
        return 0
    raise ConfigError(f"parameter {name!r} must be 0 or 1, got {value!r}")


def _positive_float(name: str, value: Any) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = -1.0
    if not number > 0:
        raise ConfigError(f"parameter {name!r} must be a positive number of seconds, got {value!r}")
    return number
