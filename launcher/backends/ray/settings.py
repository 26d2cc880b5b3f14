"""The ``--ray-*`` options, and what the placement group asks of the cluster.

Every process of the plan gets one bundle of the placement group, in plan order: the scheduler
``{"CPU": 1}``, each server ``--ray-server-resources`` and each worker ``--ray-worker-resources``
(both ``{"CPU": 1}`` unless given). ``--ray-strategy spread`` (Ray's ``SPREAD``: bundles on as many
nodes as it can, so servers land on distinct nodes when there are enough) or ``pack`` (``PACK``: on
as few nodes as it can). Pure: nothing here imports Ray.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Mapping, Sequence

from ...config import LaunchConfig
from ...errors import ConfigError

__all__ = ["RaySettings", "bundles_for", "shortfall", "never_fits", "DEFAULT_RAY_TIMEOUT", "SCHEDULER_BUNDLE", "STRATEGIES"]

#: Seconds the placement group has to be placed before pslaunch names what is missing.
DEFAULT_RAY_TIMEOUT = 60.0
#: What the scheduler asks for: it only keeps the books, one CPU is plenty.
SCHEDULER_BUNDLE = {"CPU": 1.0}
#: ``--ray-strategy`` values and Ray's names for them.
STRATEGIES = {"spread": "SPREAD", "pack": "PACK"}
_DEFAULT_BUNDLE = {"CPU": 1.0}


@dataclass(frozen=True)
class RaySettings:
    """The ray backend's options, checked."""

    address: str
    strategy: str
    worker_resources: tuple[tuple[str, float], ...]
    server_resources: tuple[tuple[str, float], ...]
    timeout: float
    timeout_given: bool = False  # --ray-timeout was given: wait for an autoscaling cluster to grow
    excludes: tuple[str, ...] = ()  # --ray-exclude: patterns left out of the working directory's upload

    @classmethod
    def from_config(cls, config: LaunchConfig, environ: Mapping[str, str]) -> "RaySettings":
        """The options of ``config`` (``--ray-address`` defaults to ``RAY_ADDRESS``, then ``auto``:
        the cluster this machine is a node of). Raises ``ConfigError`` naming the option and value."""
        address = (config.ray.address or environ.get("RAY_ADDRESS", "") or "auto").strip()
        strategy = (config.ray.strategy or "spread").strip().lower()
        if strategy not in STRATEGIES:
            raise ConfigError(f"--ray-strategy {config.ray.strategy!r}: expected spread (servers on distinct "
                              "nodes when there are enough) or pack (as few nodes as possible)")
        timeout_text = config.ray.timeout
        timeout = DEFAULT_RAY_TIMEOUT
        if timeout_text is not None:
            try:
                timeout = float(timeout_text)
            except ValueError:
                timeout = math.nan
            if not timeout > 0 or math.isinf(timeout):
                raise ConfigError(f"--ray-timeout {timeout_text!r}: expected a number of seconds > 0")
        return cls(address=address, strategy=strategy,
                   worker_resources=_parse_resources("--ray-worker-resources", config.ray.worker_resources),
                   server_resources=_parse_resources("--ray-server-resources", config.ray.server_resources),
                   timeout=timeout, timeout_given=timeout_text is not None,
                   excludes=tuple(config.ray.exclude or ()))


def _parse_resources(flag: str, text: str | None) -> tuple[tuple[str, float], ...]:
    """``'{"CPU": 1, "GPU": 1}'`` as sorted ``(name, amount)`` pairs; ``{"CPU": 1}`` when not given.
    Raises ``ConfigError`` naming ``flag`` for anything but a JSON object of non-negative numbers with
    one amount above 0 (Ray refuses an empty bundle)."""
    if text is None:
        return tuple(sorted(_DEFAULT_BUNDLE.items()))
    example = f"""expected a JSON object of amounts, e.g. {flag} '{{"CPU": 1, "GPU": 1}}'"""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{flag} {text!r} is not JSON ({exc.msg}); {example}") from None
    if not isinstance(value, dict) or not value:
        raise ConfigError(f"{flag} {text!r}: {example}")
    out = {}
    for name, amount in value.items():
        if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not amount >= 0 or math.isinf(amount):
            raise ConfigError(f"{flag}: {name} {amount!r} is not an amount (a number >= 0); {example}")
        out[name] = float(amount)
    if not any(out.values()):
        raise ConfigError(f"{flag} {text!r} asks for nothing: Ray places no empty bundle; {example}")
    return tuple(sorted(out.items()))


def bundles_for(roles: Sequence[str], settings: RaySettings) -> list[dict[str, float]]:
    """One bundle per process, in plan order, from each process's role."""
    by_role = {"scheduler": dict(SCHEDULER_BUNDLE), "server": dict(settings.server_resources),
               "worker": dict(settings.worker_resources)}
    return [dict(by_role[role]) for role in roles]


def _amount(value: float) -> str:
    return f"{value:g}" if value < 1e6 else f"{value / 2**30:.1f} GiB"


def _needs(bundles: Sequence[Mapping[str, float]]) -> dict[str, float]:
    need: dict[str, float] = {}
    for bundle in bundles:
        for name, amount in bundle.items():
            need[name] = need.get(name, 0.0) + amount
    return need


def never_fits(bundles: Sequence[Mapping[str, float]], total: Mapping[str, float],
               nodes: Sequence[Mapping[str, float]]) -> str | None:
    """Why a cluster of ``total`` resources (``nodes``: each live node's total) can never hold
    ``bundles``, however long it is waited for, as a phrase (``needs 4 GPU, cluster has 2``; a bundle
    no node can hold); None when it could once other jobs free what they hold."""
    lacking = [f"needs {_amount(amount)} {name}, cluster has {_amount(total.get(name, 0.0))}"
               for name, amount in sorted(_needs(bundles).items()) if amount > total.get(name, 0.0) + 1e-9]
    if lacking:
        return "; ".join(lacking)
    for bundle in bundles:
        if not any(all(node.get(name, 0.0) + 1e-9 >= amount for name, amount in bundle.items()) for node in nodes):
            shown = json.dumps({name: amount for name, amount in bundle.items()})
            return f"no node of the cluster can hold a bundle of {shown} (the largest node has " + ", ".join(
                f"{_amount(max((node.get(name, 0.0) for node in nodes), default=0.0))} {name}" for name in bundle) + ")"
    return None


def shortfall(bundles: Sequence[Mapping[str, float]], total: Mapping[str, float], available: Mapping[str, float],
              nodes: Sequence[Mapping[str, float]], strategy: str) -> str:
    """Why ``bundles`` did not fit a cluster with ``total`` resources (``available`` of them free,
    ``nodes``: each live node's total), as a phrase: what it can never hold (``never_fits``);
    resources others use; else the strategy's constraint."""
    never = never_fits(bundles, total, nodes)
    if never is not None:
        return never
    need = _needs(bundles)
    busy = [f"needs {_amount(amount)} {name}, {_amount(available.get(name, 0.0))} of the cluster's "
            f"{_amount(total.get(name, 0.0))} are free" for name, amount in sorted(need.items())
            if amount > available.get(name, 0.0) + 1e-9]
    if busy:
        return "; ".join(busy) + " (other jobs hold the rest)"
    return f"the nodes could not hold the bundles together under --ray-strategy {strategy}"
