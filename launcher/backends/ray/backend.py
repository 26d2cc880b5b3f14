"""pslaunch's side of ``--launcher ray``: connect, place, start, watch, remove.

``prepare`` connects to the cluster (``--ray-address``) with pslaunch's directory as the job's
``runtime_env`` ``working_dir`` (Ray copies it to every node, as rsync does for ssh), asks for one
placement group with a bundle per process (``settings``) and waits ``--ray-timeout`` for it: a
group Ray cannot place is removed and the error names what the cluster lacks. It then starts one
``ProcessActor`` in each bundle, learns each bundle's node, picks the scheduler's port on its node,
and returns the plan placed on those nodes (``placement``). ``launch`` has each actor start its
process (again for every attempt of ``--max-restarts``: the actors and the group stay).

Each process is a ``RayHandle``: a thread calls the actor's ``read`` in a loop (a long poll) and
prints what comes, with the usual prefixes; the exit code arrives once every byte did. A handle
whose actor died (its node left the cluster, its worker was killed) is lost: exit 255, the node is
the root cause, at the time pslaunch last heard from it. A call that goes unanswered for a while
puts the handle in doubt, so the supervisor waits for Ray's verdict before it blames a bystander.
Stop, Ctrl-Z and the end of bundled nodes are ``tell`` calls. ``close`` kills every actor, removes
the placement group and disconnects, on every path (Ctrl-C, ``--timeout``, a failure, an error).
"""

from __future__ import annotations

import json
import logging
import os
import random
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import replace

from ...errors import ConfigError, PlacementError, PreflightError, SpawnError, SyncError
from ...observe.output import LineSplitter
from ...planning.network import parse_interface
from ...planning.plan import Plan, ProcessSpec
from ..base import Backend, ExitStatus, GuardedHandle, ProcessHandle, route_block
from ..checks.script import check_scripts_here
from .placement import PENDING_HOST, assign_bundles, place
from .settings import STRATEGIES, RaySettings, bundles_for, never_fits, shortfall
from .upload import check_working_dir

__all__ = ["RayBackend", "RayHandle", "READ_WAIT"]

#: Seconds an actor's ``read`` waits for output before it answers with none (the long poll).
READ_WAIT = 0.5
#: Seconds past ``READ_WAIT`` without an answer after which the handle's node is in doubt.
DOUBT_AFTER = 3.0
#: Seconds the actors have to start on their nodes (a new Python worker each, the working directory
#: unpacked) and to answer a start.
START_WAIT = 120.0


def _ray():
    """The ``ray`` module; ``ConfigError`` saying how to install it when it is missing."""
    try:
        import ray
    except ImportError:
        raise ConfigError("--launcher ray needs Ray in pslaunch's Python: pip install 'pslaunch[ray]'") from None
    return ray


class RayHandle(GuardedHandle):
    """A process a ``ProcessActor`` runs on its node; see the module docstring."""

    def __init__(self, spec: ProcessSpec, actor, printer) -> None:
        super().__init__(spec)
        self.actor = actor
        self._printer = printer
        self._exit: ExitStatus | None = None
        self._asked_at: float | None = None  # when the pending read was sent
        self._heard = time.monotonic()  # when the actor last answered
        self._thread = threading.Thread(target=self._follow, name=f"pslaunch-ray-{spec.name}", daemon=True)
        self._closing = False

    def follow(self) -> None:
        """Start reading the actor's output (once the actor started the process)."""
        self._thread.start()

    def _follow(self) -> None:
        splitters = {stream: LineSplitter(lambda block, s=stream: route_block(self, s, self._printer, block))
                     for stream in ("stdout", "stderr")}
        try:
            exit_status = self._read_until_exit(splitters)
        finally:
            for splitter in splitters.values():
                splitter.close()  # a last partial line: in before the exit is
        self._exit = exit_status

    def _read_until_exit(self, splitters: dict[str, LineSplitter]) -> ExitStatus | None:
        """Feed the actor's output to ``splitters`` until its process exited (its status) or the
        actor is lost (a lost status); None when ``close`` ended the reading first."""
        ray = _ray()
        while not self._closing:
            self._asked_at = time.monotonic()
            try:
                answer = ray.get(self.actor.read.remote(READ_WAIT))
            except ray.exceptions.ActorUnavailableError:
                time.sleep(READ_WAIT)  # unreachable for now: in doubt until it answers or dies
                continue
            except ray.exceptions.RayActorError as exc:
                return self._lost_actor(exc)
            except Exception as exc:  # noqa: BLE001 - Ray's connection ended under the reader
                return None if self._closing else self._lost_actor(exc)
            self._heard, self._asked_at = time.monotonic(), None
            for stream, data in answer["out"].items():
                splitters[stream].feed(data)
            if answer["done"]:
                code = answer["code"]
                return ExitStatus(code=code) if code >= 0 else ExitStatus(signal=-code)
        return None

    def _lost_actor(self, exc: Exception) -> ExitStatus:
        node = self.spec.host.label
        if not isinstance(exc, _ray().exceptions.RayActorError):
            why = f"pslaunch lost its connection to the Ray cluster ({type(exc).__name__}: {_first_line(exc)})"
        elif _node_alive(node):
            why = f"its Ray actor died ({type(exc).__name__})"
        else:
            why = f"its Ray node {node} left the cluster"
        return self._lost(why, self._heard)  # its last sign of life orders the failures

    def _poll(self) -> ExitStatus | None:
        return self._exit

    def in_doubt(self) -> bool:
        asked = self._asked_at
        return self.status is None and asked is not None and time.monotonic() - asked > READ_WAIT + DOUBT_AFTER

    def _tell(self, verb: str) -> None:
        if self._exit is not None and verb != "KILL":
            return
        try:
            self.actor.tell.remote(verb)
        except Exception:  # noqa: BLE001 - Ray refuses calls to a dead actor; nothing runs there to signal
            pass

    def close(self, timeout: float = 2.0) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._closing = True  # a reader still waiting on a silent node ends with its next answer or error


def _node_alive(address: str) -> bool:
    """Whether Ray lists a live node at ``address`` (True when it cannot tell)."""
    try:
        nodes = _ray().nodes()
    except Exception:  # noqa: BLE001 - the verdict stays "actor died"
        return True
    return any(node.get("Alive") and node.get("NodeManagerAddress") == address for node in nodes)


class RayBackend(Backend):
    """Runs the job on a Ray cluster (``--launcher ray``); see the module docstring. Not thread-safe."""

    name = "ray"
    refuses = {"hostfile": "Ray places the processes on its nodes (the placement group is the hostfile)",
               "scheduler_host": "Ray places the scheduler with the other processes",
               "ssh": "Ray starts the processes; pslaunch uses no ssh",
               "link_timeout": "Ray tells pslaunch when a node leaves the cluster",
               "cpu_bind": "Ray gives its actors CPUs (--ray-worker-resources '{\"CPU\": 2}') and pslaunch does not "
                           "pin them"}

    def __init__(self, config, printer) -> None:
        super().__init__(config, printer)
        self.settings = RaySettings.from_config(config, os.environ)
        self._connected = False
        self._group = None
        self._actors: dict[tuple[str, int], object] = {}  # (role, rank) -> its actor
        self._python: str | None = None
        self._ray_printing = None  # Ray's own printer of the cluster's errors, while pslaunch holds it

    # -- before anything starts ----------------------------------------------------------------------
    @classmethod
    def resolve(cls, config):
        return config  # Ray's nodes hold the processes: the addresses and ports are found there (``configure``, ``prepare``)

    @classmethod
    def configure(cls, config, environ):
        RaySettings.from_config(config, environ)
        if config.gpus_per_worker:
            raise ConfigError("--gpus-per-worker is not an option of --launcher ray: ask Ray for the GPUs with "
                              """--ray-worker-resources '{"CPU": 1, "GPU": K}', and Ray gives each worker its own """
                              "(CUDA_VISIBLE_DEVICES)")
        if config.interface:
            parse_interface(config.interface)
        # Ports on nodes pslaunch cannot probe before placement: below Linux's ephemeral range (32768),
        # which no node's kernel hands to an outgoing connection; ``prepare`` checks them on the node.
        scheduler_port = config.scheduler_port or random.randrange(16384, 32768)
        master_port = config.master_port or random.choice([p for p in range(16384, 32768) if p != scheduler_port])
        return replace(config, hosts=(PENDING_HOST,), scheduler_host=PENDING_HOST.name, launch_address=PENDING_HOST.name,
                       scheduler_port=scheduler_port, master_port=master_port)

    @classmethod
    def check_without_starting(cls, config, plan) -> None:
        # the script is looked for here: Ray copies this directory (to --sync-dst-dir too)
        check_scripts_here([replace(spec, cwd=None) for spec in plan.processes], config.cwd)
        check_working_dir(config.sync_src_dir, RaySettings.from_config(config, os.environ).excludes)

    @classmethod
    def dry_run_notes(cls, config):
        settings = RaySettings.from_config(config, os.environ)
        bundles = bundles_for(_roles(config), settings)
        shown = {"scheduler": bundles[0]}
        if config.num_servers:
            shown["server"] = bundles[1]
        shown["worker"] = bundles[-1]
        return [f"ray: connects to the Ray cluster at {settings.address} and asks for one placement group of "
                f"{len(bundles)} bundles (--ray-strategy {settings.strategy}, Ray's {STRATEGIES[settings.strategy]}): "
                + "; ".join(f"{role} {json.dumps(bundle)}" for role, bundle in shown.items())
                + f"; waits {settings.timeout:g} s for it (--ray-timeout)",
                f"ray: {PENDING_HOST.name} stands for the node each bundle lands on; the scheduler's port is checked "
                "free on its node; the code reaches the nodes as the job's runtime_env working_dir "
                f"({config.sync_src_dir})"]

    @classmethod
    def dry_run_plan(cls, config, plan: Plan) -> Plan:
        # where the processes start: Ray's copy of the working directory, or --sync-dst-dir
        return replace(plan, processes=tuple(replace(spec, cwd=config.sync_dst_dir) for spec in plan.processes))

    def prepare(self, plan: Plan) -> Plan:
        """Connect, place the group (blocks up to ``--ray-timeout``), start the actors and return the
        plan placed on their nodes. Raises ``PreflightError`` (no cluster), ``SyncError`` (the working
        directory), ``PlacementError`` (the group cannot be placed), ``SpawnError``."""
        with _signals_through_ray():
            return self._prepare(plan)

    def _prepare(self, plan: Plan) -> Plan:
        self.check_without_starting(self.config, plan)
        ray = _ray()
        started = time.monotonic()
        self._connect(ray)
        from ray.util.placement_group import placement_group

        bundles = bundles_for([spec.role for spec in plan.processes], self.settings)
        if not self.settings.timeout_given:  # no waiting for what the cluster can never hold
            never = self._never_fits(ray, bundles)
            if never is not None:
                raise PlacementError(f"Ray cannot place the job's {len(bundles)} bundles: {never} (the cluster's own "
                                     "resources, so pslaunch does not wait; on a cluster that grows on demand give "
                                     "--ray-timeout S to wait for it)")
        strategy = STRATEGIES[self.settings.strategy]
        self._group = placement_group(bundles, strategy=strategy, name=f"pslaunch-{self.config.job_id}")
        try:
            _get(ray, [self._group.ready()], self.settings.timeout)
        except ray.exceptions.GetTimeoutError:
            why = self._shortfall(ray, bundles)
            raise PlacementError(f"Ray could not place the job's {len(bundles)} bundles within --ray-timeout "
                                 f"{self.settings.timeout:g} s: {why}") from None
        if self.config.verbose:
            self.printer.note(f"ray: placement group of {len(bundles)} bundles placed in "
                              f"{time.monotonic() - started:.2f} s")
        roles = [spec.role for spec in plan.processes]
        actors = [self._actor(ray, index, bundles[index])
                  for index in assign_bundles(roles, bundles, self._bundle_nodes(ray, len(bundles)))]
        for spec, actor in zip(plan.processes, actors):
            self._actors[(spec.role, spec.rank)] = actor
        try:
            places = _get(ray, [actor.where.remote() for actor in actors], START_WAIT)
        except ray.exceptions.RuntimeEnvSetupError as exc:
            raise SyncError(f"Ray could not set up the working directory {self.config.sync_src_dir} on a node: "
                            f"{_first_line(exc)}") from None
        except ray.exceptions.GetTimeoutError:
            raise SpawnError(f"the job's Ray actors did not start within {START_WAIT:g} s") from None
        except ray.exceptions.RayError as exc:
            raise SpawnError(f"a Ray actor of the job could not start: {type(exc).__name__}: {_first_line(exc)}"
                             ) from None
        # The first word of COMMAND and of the runtime is pslaunch's Python: each node runs its own
        # (the one Ray's workers run, with Ray and pslaunch installed) unless --python named another.
        self._python = sys.executable if self.config.python == sys.executable else None
        port = self._port_on(ray, actors[0], plan.root_port, "the scheduler")
        master = None
        if self.config.master_port is not None:
            first = next(i for i, spec in enumerate(plan.processes) if spec.role == "worker" and spec.rank == 0)
            master = self._port_on(ray, actors[first], self.config.master_port, "worker 0 (torch's MASTER_PORT)")
        placed = place(plan, self.config, [p["ip"] for p in places], port, master)
        if self.config.verbose:
            nodes = sorted({p["ip"] for p in places})
            self.printer.note(f"ray: {len(actors)} actors on {len(nodes)} node(s) ({', '.join(nodes)}) in "
                              f"{time.monotonic() - started:.2f} s")
        return placed

    def _bundle_nodes(self, ray, count: int) -> list[str]:
        """The node each bundle of the placed group is on (Ray's node ids)."""
        table = ray.util.placement_group_table(self._group)
        return [str(table["bundles_to_node_id"].get(index, "")) for index in range(count)]

    def _port_on(self, ray, actor, port: int, what: str) -> int:
        """``port`` when it is free on ``actor``'s node, else one that is (said with -v)."""
        chosen = _get(ray, [actor.free_port.remote(port)], START_WAIT)[0]
        if chosen != port and self.config.verbose:
            self.printer.note(f"ray: port {port} is taken on the node of {what}; {chosen} instead")
        return chosen

    def _connect(self, ray) -> None:
        size = check_working_dir(self.config.sync_src_dir, self.settings.excludes)
        excludes = [*self.settings.excludes, *(f"/{folder}" for folder in size.left_out)]
        if self.config.verbose:
            left = f"; Ray's own folders left out: {', '.join(size.left_out)}" if size.left_out else ""
            self.printer.note(f"ray: the working directory {self.config.sync_src_dir} holds {size.total} bytes to "
                              f"upload{left}")
        runtime_env = {"working_dir": self.config.sync_src_dir, **({"excludes": excludes} if excludes else {})}
        try:
            ray.init(address=self.settings.address, runtime_env=runtime_env, namespace=f"pslaunch-{self.config.job_id}",
                     log_to_driver=False, logging_level=logging.ERROR, configure_logging=True)
        except ray.exceptions.RuntimeEnvSetupError as exc:  # the working directory could not be packed or sent
            why = " ".join(str(exc).split())
            raise SyncError(f"Ray could not take the working directory {self.config.sync_src_dir} as the job's "
                            f"runtime_env: {why[:500]}") from None
        except ConnectionError as exc:
            raise PreflightError(f"cannot connect to the Ray cluster at {self.settings.address} (--ray-address, "
                                 f"RAY_ADDRESS): {_first_line(exc)}") from None
        except (ValueError, OSError, RuntimeError) as exc:
            text = _first_line(exc)
            if "working_dir" in text or "package" in text.lower():
                raise SyncError(f"Ray refused the working directory {self.config.sync_src_dir} as the job's "
                                f"runtime_env: {text}") from None
            raise PreflightError(f"cannot connect to the Ray cluster at {self.settings.address}: {text}") from None
        self._connected = True
        self._hold_ray_messages()

    def _hold_ray_messages(self) -> None:
        """Ray's driver prints the errors the cluster publishes (a dead raylet's last 20 log lines)
        straight to pslaunch's stderr, past the printer and its prefixes. pslaunch reports a lost
        node itself; Ray's words go to ``-v``, one line each. (Ray reads the function from its
        module at each message, so replacing it there is enough.)"""
        worker = sys.modules.get("ray._private.worker")
        if worker is None or not hasattr(worker, "print_to_stdstream"):
            return
        printer, verbose = self.printer, self.config.verbose

        def said(data, *args, **kwargs) -> None:
            lines = [line.strip() for line in (data.get("lines") or []) if line.strip()]
            if verbose and lines:
                printer.note(f"ray ({data.get('pid', 'cluster')}): {lines[0][:300]}")

        self._ray_printing = worker.print_to_stdstream
        worker.print_to_stdstream = said

    def _actor(self, ray, index: int, bundle: dict[str, float]):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from ...on_node.ray_actor import ProcessActor

        others = {name: amount for name, amount in bundle.items() if name not in ("CPU", "GPU", "memory")}
        options = {"num_cpus": bundle.get("CPU", 0.0), "num_gpus": bundle.get("GPU", 0.0), "max_concurrency": 4,
                   "max_restarts": 0, "scheduling_strategy": PlacementGroupSchedulingStrategy(
                       self._group, placement_group_bundle_index=index)}
        if others:
            options["resources"] = others
        if bundle.get("memory"):
            options["memory"] = bundle["memory"]
        return ray.remote(ProcessActor).options(**options).remote()

    def _never_fits(self, ray, bundles) -> str | None:
        try:
            nodes = [node.get("Resources", {}) for node in ray.nodes() if node.get("Alive")]
            return never_fits(bundles, ray.cluster_resources(), nodes)
        except Exception:  # noqa: BLE001 - Ray did not say: wait for the group as before
            return None

    def _shortfall(self, ray, bundles) -> str:
        try:
            nodes = [node.get("Resources", {}) for node in ray.nodes() if node.get("Alive")]
            return shortfall(bundles, ray.cluster_resources(), ray.available_resources(), nodes,
                             self.settings.strategy)
        except Exception as exc:  # noqa: BLE001 - the error still says the group was not placed
            return f"Ray did not say what is missing ({type(exc).__name__})"

    # -- attempts ----------------------------------------------------------------------------------
    def launch(self, plan: Plan) -> list[ProcessHandle]:
        with _signals_through_ray():
            return self._launch(plan)

    def _launch(self, plan: Plan) -> list[ProcessHandle]:
        ray = _ray()
        handles: list[RayHandle] = []
        calls = []
        try:
            for spec in plan.processes:
                actor = self._actors[(spec.role, spec.rank)]
                calls.append(actor.start.remote(list(spec.argv), spec.full_env(), spec.cwd, self.config.stop_grace,
                                                self._python))
                handles.append(RayHandle(spec, actor, self.printer))
            try:
                _get(ray, calls, START_WAIT)
            except ray.exceptions.RayActorError as exc:
                lost = [h.spec.name for h, call in zip(handles, calls) if _failed(ray, call)]
                raise SpawnError(f"cannot start {', '.join(lost) or 'the job'}: its Ray actor is gone "
                                 f"({_first_line(exc)})") from None
            except ray.exceptions.RayTaskError as exc:
                cause = getattr(exc, "cause", None) or exc
                raise SpawnError(f"cannot start a process of the job: {type(cause).__name__}: {_first_line(cause)}"
                                 ) from None
            except ray.exceptions.GetTimeoutError:
                raise SpawnError(f"the job's Ray actors did not start their processes within {START_WAIT:g} s") from None
            for handle in handles:
                handle.follow()
        except Exception:
            for handle in handles:
                handle.kill()
            raise
        return list(handles)

    def close(self) -> None:
        """Kill every actor (their guards stop what still runs), remove the placement group and
        disconnect. Idempotent."""
        if not self._connected:
            return
        ray = _ray()
        for actor in self._actors.values():
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already dead
                pass
        self._actors.clear()
        if self._group is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self._group)
            except Exception as exc:  # noqa: BLE001 - say it; the group goes with the job anyway
                self.printer.note(f"ray: could not remove the placement group: {_first_line(exc)}")
            self._group = None
        ray.shutdown()
        self._connected = False
        worker = sys.modules.get("ray._private.worker")
        if worker is not None and self._ray_printing is not None:
            worker.print_to_stdstream = self._ray_printing  # a later driver in this process (launcher.launch)
            self._ray_printing = None


@contextmanager
def _signals_through_ray():
    """Ray's core looks for signals inside its waits and runs pslaunch's handler there; what the
    handler raises (the supervisor's interruption, on Ctrl-C) comes out of Ray as a ``SystemError``
    caused by it. The cause goes on, as if Ray had not been in between."""
    try:
        yield
    except SystemError as exc:
        cause = exc.__cause__ or exc.__context__
        if cause is None or isinstance(cause, SystemError):
            raise
        raise cause from None


def _get(ray, refs: list, timeout: float) -> list:
    """``ray.get(refs)`` within ``timeout`` s (``GetTimeoutError`` then), waiting in short slices:
    an interruption (Ctrl-C) raised inside one long wait stays in Ray's core until the wait ends,
    so pslaunch would sit out the whole ``--ray-timeout``; a slice ends within 0.2 s."""
    deadline = time.monotonic() + timeout
    pending = list(refs)
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ray.exceptions.GetTimeoutError(f"{len(pending)} of {len(refs)} call(s) unanswered after {timeout:g} s")
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=min(left, 0.2))
    return ray.get(refs)


def _roles(config) -> list[str]:
    return ["scheduler"] + ["server"] * config.num_servers + ["worker"] * config.num_workers


def _failed(ray, call) -> bool:
    try:
        ray.get(call, timeout=0)
    except Exception:  # noqa: BLE001 - any failure of that start
        return True
    return False


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
