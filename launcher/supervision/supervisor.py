"""Supervision: run a plan through a backend, watch every process, stop everything at the end.

Rules (docs/launcher.md, "Failures"):

* a process that fails on its own (non-zero exit other than 75, a signal, or the runtime's report
  of its uncaught error) ends the job: every other process is stopped (SIGTERM and SIGCONT, a
  grace period, SIGKILL) and the root cause is named (``launcher.supervision.verdict``);
* a process that exits 75 ended because another one failed: pslaunch waits up to
  ``CULPRIT_WAIT`` seconds for the process that failed on its own before it stops the rest, so
  that the root cause is the culprit, not the first bystander to notice (and longer while a host
  has gone quiet, until it is heard from again or lost: ``--link-timeout``);
* a scheduler or server that exits, even with 0, before every worker has finished fails the job
  (exit code 1 when it exited 0; after exit 0 the workers get ``shutdown_grace`` seconds to
  finish too, since the runtime may end a moment before the workers' interpreters do);
* when every worker has exited 0, each bundled scheduler and server (those that wrote the READY
  marker) is asked to end (SIGUSR1) and exits 0 at once; others get ``shutdown_grace`` seconds to
  exit by themselves and are then stopped; the job succeeded;
* ``--max-restarts N``: after a failure of a process the job is started again (or, with
  ``--restart-scope worker``, a failed worker alone) while restarts are left (``launcher.supervision.restarts``);
  the summary lists each attempt, its root cause and what followed, and each worker replaced in
  place: when, and how long the others waited for it (``launcher.supervision.replacements``);
* ``--timeout`` bounds the whole job (exit 124); SIGINT / SIGTERM / SIGHUP stop it (exit 128+n),
  a second one skips the grace period; SIGTSTP (Ctrl-Z) stops every process and pslaunch, SIGCONT
  continues them.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import replace

from pscontract import PSLAUNCH_SERVER_REPLICA

from ..backends.base import Backend, ProcessHandle
from ..config import LaunchConfig
from ..errors import LaunchError
from ..observe.output import Printer
from ..observe.terminal import in_foreground
from ..on_node.process_groups import stop
from ..planning.capacity import machine_of
from ..planning.plan import Plan, ProcessSpec
from .elastic import ElasticCapacity, capacity_of
from .preemption import Preemption
from .replacements import ReplacementLog
from .restarts import RestartLog
from .result import RunResult, result_of
from .stalls import StallEnd
from .verdict import Failure, culprit, kind_of, notes, who

__all__ = ["Supervisor", "Failure", "EXIT_TIMEOUT", "CULPRIT_WAIT"]

#: pslaunch's exit code when ``--timeout`` ran out (as timeout(1)).
EXIT_TIMEOUT = 124
#: Seconds pslaunch waits, once a process ended because of a peer, for the one that failed itself.
CULPRIT_WAIT = 5.0
_TICK = 0.05
_STOPPING = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class _Interrupted(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


#: What ``_watch`` returns when processes failed: the verdict comes once output is read.
_PROCESS_FAILED = Failure("a process failed", 1)


class Supervisor:
    """Runs one job. ``run`` blocks until the job is over and returns pslaunch's exit code.

    Must be used from the main thread (it installs signal handlers while running).
    """

    def __init__(self, config: LaunchConfig, backend: Backend, printer: Printer, observer=None) -> None:
        self.config = config
        self.backend = backend
        self.printer = printer
        self.observer = observer  # launcher.observe.observer.JobObserver: the dashboard, metrics, timeline, summary
        self.handles: list[ProcessHandle] = []
        self.failure: Failure | None = None
        self._signals: list[int] = []
        self._raise_on_signal = True
        self._stopped: set[int] = set()
        self._suspend_asked = False
        self._resume_asked = False
        self._suspended = False  # the job's processes were stopped by Ctrl-Z and not continued yet
        self._paused = 0.0  # seconds the job spent stopped by Ctrl-Z (not counted by --timeout)
        self.restarts = RestartLog(config.max_restarts, config.restart_scope,
                                   bool(config.checkpoint_dir or config.allow_restart_from_scratch))
        self._plan: Plan | None = None
        self._replaced: list[ProcessHandle] = []  # workers restarted alone (--restart-scope worker)
        self._lost_holders: set[int] = set()  # servers and replicas lost while a replica held their keys
        self._stalls_read = 0.0  # the newest stall report acted on (``_stacks_of_stalled``)
        self._stack_asked: dict[int, float] = {}  # worker handle id -> when its stack was last asked for
        self._stall_end = StallEnd(self.printer, config.backend)  # --stall-timeout
        self._preemption = Preemption(config.stop_grace, printer.note)  # SIGTERM to a job that keeps checkpoints
        source = backend.capacity() or capacity_of(config)  # an elastic job's hosts as they come and go
        self._capacity = None if source is None else ElasticCapacity(config, source, printer.note, self._start_joiner)
        self._unusable: set[tuple] = set()  # hosts a joiner could not be started on (said once)
        self._dropped: set[int] = set()  # ids of an elastic job's workers that were lost and dropped
        self.replacements = ReplacementLog(time.monotonic())  # every attempt's: the job's start counts from run()

    # -- signals -------------------------------------------------------------------------------
    def _on_signal(self, signum: int, frame) -> None:  # noqa: ARG002
        if signum == signal.SIGTSTP:
            self._suspend_asked = True
            return
        if signum == signal.SIGCONT:
            self._resume_asked = True
            return
        self._signals.append(signum)
        if self._raise_on_signal:
            self._raise_on_signal = False
            raise _Interrupted(signum)

    def _install(self) -> dict[int, object]:
        old = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (*_STOPPING, signal.SIGTSTP, signal.SIGCONT):
                old[sig] = signal.signal(sig, self._on_signal)
        return old

    # -- the job -------------------------------------------------------------------------------
    def run(self, plan: Plan) -> int:
        """Prepare, launch and supervise ``plan``, restarting it while ``--max-restarts`` allows
        (``launcher.supervision.restarts``); returns the exit code (the last root cause's). Raises
        ``LaunchError`` from the backend's preparation (pre-flight, rsync, the script check) and
        from starting processes."""
        old = self._install()
        start = time.monotonic()
        self._plan = plan
        self.replacements = ReplacementLog(start)
        if self.observer is not None:
            self.observer.replacements = self.replacements.records
        ended: tuple[int, str | None] = (1, "pslaunch on node 0 ended before the job did")
        try:
            try:
                self._attempt(plan, start, prepare=True)
                while self.restarts.can_restart(self.failure) and not self._signals:
                    assert self.failure is not None
                    count = self.restarts.restart(self.failure, "the job")
                    self._report(f"restarting the job (restart {count} of {self.restarts.max_restarts}, "
                                 f"PSLAUNCH_RESTART_COUNT={count})")
                    self.handles, self._replaced, self._stopped, self.failure = [], [], set(), None
                    self._stall_end = StallEnd(self.printer, self.config.backend)
                    self._lost_holders = set()
                    self._attempt(self._plan.restarted(count), start)
                held_back = self.restarts.held_back(self.failure)
                if held_back is not None:
                    self.printer.note(held_back)
                if self.restarts.max_restarts:
                    self.restarts.finish(self.failure)
                ended = (0, None) if self.failure is None else (self.failure.exit_code, self.failure.final_reason)
            except LaunchError as exc:
                ended = (exc.exit_code, f"the job could not start: {exc}")
                raise
            finally:
                try:
                    self.backend.job_ended(*ended)
                finally:
                    self.backend.close()
            self._report()
        finally:
            # only now: a Ctrl-C more while the job is torn down and reported must not cut the table off
            for sig, handler in old.items():
                signal.signal(sig, handler)  # type: ignore[arg-type]
        return 0 if self.failure is None else self.failure.exit_code

    def _attempt(self, plan: Plan, start: float, prepare: bool = False) -> None:
        """Launch ``plan`` (after the backend's preparation) and watch it to its end; ``failure``
        then says why it failed (None: it succeeded)."""
        try:
            try:
                if prepare:  # a batch scheduler's hosts are known now: the plan of every attempt has them
                    plan = self._plan = self.backend.prepare(plan) or plan
                self.printer.starting(spec.name for spec in plan.processes)
                self.handles = self.backend.launch(plan)
                if self.observer is not None:
                    self.observer.attach(self.handles)
                self._raise_on_signal = False
                if self._signals:
                    raise _Interrupted(self._signals[0])
            except _Interrupted as exc:
                self.failure = Failure(f"pslaunch got {signal.Signals(exc.signum).name}", 128 + exc.signum)
            else:
                self.failure = self._watch(start)
            self._teardown()
        finally:
            for handle in self._replaced + self.handles:
                handle.close()  # reader threads finish: every marker and last line is in
        if self.failure is _PROCESS_FAILED:
            self.failure = self._root_cause() or Failure("a process failed", 1)

    def _check_signal_or_timeout(self, start: float) -> Failure | None:
        if self._signals:
            sig = self._signals[0]
            if sig == signal.SIGTERM and len(self._signals) == 1 and self.config.checkpoint_dir:
                return self._preemption.step(self.handles, time.monotonic())  # worker 0 commits first
            return Failure(f"pslaunch got {signal.Signals(sig).name}", 128 + sig)
        outside = self.backend.interruption()
        if outside is not None:
            return Failure(outside.reason, outside.exit_code)
        if self.config.timeout is not None and time.monotonic() - start - self._paused > self.config.timeout:
            stalls = sorted(stall[:2] for h in self.handles for stall in h.stalls)
            waiting = f"; the job was waiting: {stalls[-1][1]}" if stalls else ""
            return Failure(f"the job ran longer than --timeout {self.config.timeout:g} s{waiting}", EXIT_TIMEOUT)
        return None

    def _watch(self, start: float) -> Failure | None:
        seen: set[int] = set()
        asked: set[int] = set()
        end_deadline: float | None = None
        blamed_at: float | None = None  # a process blamed a peer, or reported its own error
        # A scheduler or server that exits 0 while workers still run may just be quicker than the
        # workers' interpreter teardown (the runtime ends once every worker said goodbye): the
        # workers get the shutdown grace period to end too before this counts as a failure.
        early: tuple[ProcessHandle, float] | None = None
        while True:
            self._job_control()
            failure = self._check_signal_or_timeout(start)
            if failure:
                return failure
            self._restart_failed_workers()
            if self._capacity is not None and self._plan is not None:
                self._capacity.step(self.handles, self._plan, time.monotonic())
            self._stacks_of_stalled()
            failure = self._stall_end.verdict(self.handles, time.monotonic())
            if failure is not None:
                return failure
            workers = [h for h in self.handles if h.spec.role == "worker"]
            others = [h for h in self.handles if h.spec.role != "worker"]
            now = time.monotonic()
            for handle in self.handles:
                status = handle.poll()
                if handle.failed_at is not None and blamed_at is None and not self._rejoins(handle):
                    blamed_at = handle.failed_at
                if status is None or id(handle) in seen or handle is self._preemption.handle:
                    continue  # preempted, worker 0's end is the preemption's (``_check_signal_or_timeout``)
                seen.add(id(handle))
                if not status.ok:
                    handle.settle_output()  # its last markers (FINISHED) decide what its end means
                kind = kind_of(handle, self._stopped)
                if kind == "done":
                    self.printer.note(f"{who(handle)} ended after its part was done ({status.describe()}): the "
                                      "scheduler had its finish, so nothing waits for it and it is not replaced")
                    continue
                if kind == "own" and self._rejoins(handle):
                    continue  # restarted alone at the next turn
                if kind == "own" and self._dropped_from_elastic(handle):
                    self._dropped.add(id(handle))
                    self.printer.note(f"{who(handle)} was lost: {status.describe()}; the elastic job drops it (the "
                                      f"rounds it did not push to go on without it) and goes on while "
                                      f"{self.config.min_workers} workers remain (-n {self.config.min_workers}:"
                                      f"{self.config.num_workers})")
                    continue
                if kind == "own" and self._held_elsewhere(handle):
                    self._lost_holders.add(id(handle))
                    then = ("its server goes on without it" if handle.spec.role == "replica"
                            else "a replica holds its keys and serves in its place")
                    self.printer.note(f"{who(handle)} failed: {status.describe()}; the job goes on "
                                      f"(--server-replicas {self.config.server_replicas}: {then})")
                    continue
                if kind == "own":
                    # a worker that fails after a server's early end failed for want of it, unless its
                    # part was done (the server's end was the job's, and the worker's error its own)
                    if early is not None and handle.spec.role == "worker" and handle.finished_at is None:
                        return self._early_failure(early[0], f"; then {handle.spec.name} failed: {status.describe()}")
                    if any(h.in_doubt() for h in self.handles):
                        # A host went quiet: this end may be its news (mpirun kills every rank once it
                        # loses a host's daemon). The host's verdict, soon, names the first to fail.
                        blamed_at = blamed_at or now
                        continue
                    return _PROCESS_FAILED
                if kind in ("peer", "stopped"):
                    blamed_at = blamed_at or now
                elif (handle.spec.role != "worker" and end_deadline is None and early is None
                      and any(w.status is None and w.finished_at is None for w in workers)):
                    # a worker that had its finish may still be in its teardown: no cause to wait for
                    early = (handle, now + self.config.shutdown_grace)
            if blamed_at is not None:
                # A host pslaunch has stopped hearing from may be the culprit: wait for that verdict.
                waited = now - blamed_at > CULPRIT_WAIT and not any(h.in_doubt() for h in self.handles)
                if waited or all(h.status is not None for h in self.handles):
                    return _PROCESS_FAILED
            elif end_deadline is None and all(h.status is not None for h in workers):
                end_deadline = now + self.config.shutdown_grace
                if self.config.verbose:
                    self.printer.note("every worker exited 0; asking scheduler and servers to end")
            elif early is not None and now > early[1]:
                if all(w.status is not None or w.finished_at is not None for w in workers):
                    early = None  # every worker still running had its finish (its marker came late): no early end
                else:
                    return self._early_failure(early[0], "")
            if end_deadline is not None and blamed_at is None:
                running = [h for h in others if h.status is None]
                if not running:
                    return None
                for handle in running:
                    if handle.ready and id(handle) not in asked:
                        asked.add(id(handle))
                        handle.request_end()
                if now > end_deadline:
                    if self.config.verbose:
                        self.printer.note(
                            "stopping " + ", ".join(h.spec.name for h in running)
                            + f" after the {self.config.shutdown_grace:g} s shutdown grace period"
                        )
                    return None
            time.sleep(_TICK)

    def _stacks_of_stalled(self) -> None:
        """A round or barrier said stalled (``PSLAUNCH_STALL_WARN``): ask each worker it waits for for its
        Python stack, which it writes to its output (once a stall threshold at most per worker)."""
        if any(h.fatal_stall is not None for h in self.handles):
            return  # past --stall-timeout: StallEnd asks for the stack it quotes
        now = time.monotonic()
        for handle in self.handles:
            for at, text, ranks in handle.stalls:
                if at <= self._stalls_read:
                    continue
                for worker in self.handles:
                    if worker.spec.role != "worker" or worker.spec.rank not in ranks or worker.status is not None:
                        continue
                    if now - self._stack_asked.get(id(worker), -1e9) < 10.0:
                        continue
                    self._stack_asked[id(worker)] = now
                    if worker.dump_stack():
                        self.printer.note(f"{who(worker)} is what the stalled rounds, barriers or collectives wait for; its "
                                          "stack follows in its output")
                    else:
                        self.printer.note(f"{who(worker)} is what the stalled rounds, barriers or collectives wait for (--launcher "
                                          f"{self.config.backend} cannot ask it for its stack)")
        self._stalls_read = max([self._stalls_read, *(at for h in self.handles for at, _, _ in h.stalls)])

    def _dropped_from_elastic(self, handle: ProcessHandle) -> bool:
        """An elastic job's worker that was lost, not one that failed: killed by a signal (a node
        drained, the OOM killer) or its host lost, before its part was done. The runtime drops it
        (``psnode.scheduler.elastic``); a worker whose own error ended it still fails the job."""
        status = handle.status
        return (self.config.elastic and handle.spec.role == "worker" and status is not None
                and (status.signal is not None or status.lost) and handle.failed_at is None
                and handle.finished_at is None)

    def _held_elsewhere(self, handle: ProcessHandle) -> bool:
        """``--server-replicas``: a server's or replica's end is not the job's failure. The runtime gives
        a lost server's keys to a replica, or, when none is left, fails the job itself (its nodes then
        end naming it, and the lost server is the root cause)."""
        return self.config.server_replicas > 0 and handle.spec.role in ("server", "replica")

    def _rejoins(self, handle: ProcessHandle) -> bool:
        """True when ``handle`` is a worker or the scheduler, restarted alone if it fails (``--restart-scope
        worker`` with a restart left); a worker only before its part is done: after its finish the rounds
        are over, and a replacement would find the job ending."""
        # the scheduler too: the nodes of the job register with the one started in its place (it holds
        # no training state), while the data path between workers and servers goes on
        return ((handle.spec.role in ("worker", "scheduler") or self._held_elsewhere(handle))
                and self.restarts.scope == "worker" and handle.finished_at is None
                and self.restarts.used < self.restarts.max_restarts)

    def _restart_failed_workers(self) -> None:
        """``--restart-scope worker``: start a worker that failed on its own and has ended again,
        alone, with its rank; the other processes go on (the runtime lets it rejoin)."""
        for i, handle in enumerate(self.handles):
            status = handle.poll()
            if not self._rejoins(handle) or status is None or status.ok:
                continue
            handle.settle_output()  # a FINISHED marker still in its pipe: it needs no replacement
            if kind_of(handle, self._stopped) != "own" or not self._rejoins(handle):
                continue
            assert handle.status is not None and self._plan is not None
            failure = Failure(f"{who(handle)} failed: {handle.status.describe()}", handle.status.exit_code, handle)
            count = self.restarts.restart(failure, f"{handle.spec.name} alone")
            how = " as a replica" if self._held_elsewhere(handle) else ""
            self.printer.note(f"{failure.reason}; restarting it alone{how} (restart {count} of {self.restarts.max_restarts}, "
                              f"PSLAUNCH_RESTART_COUNT={count}); the other processes go on")
            self._replaced.append(handle)
            self.printer.starting([handle.spec.name])
            spec = handle.spec
            if self._held_elsewhere(handle):  # a lost server or replica comes back as a replica: its rank's
                spec = replace(spec, env={**spec.env, PSLAUNCH_SERVER_REPLICA: "1"})  # keys are served meanwhile
            self.handles[i] = self.backend.launch(self._plan.restarted(count, (spec,)))[0]
            self.replacements.add(handle, self.handles[i], count)
            if self.observer is not None:
                self.observer.attach(self.handles)

    def _start_joiner(self, spec: ProcessSpec) -> None:
        """Start a worker that joins the running elastic job (``launcher.supervision.elastic``). A host
        it cannot start on is said once and left alone: the job goes on without that capacity."""
        assert self._plan is not None
        machine = machine_of(spec.host)
        if machine in self._unusable:
            return
        plan = replace(self._plan, processes=(spec,))
        try:
            self.backend.prepare_more(plan)
            handle = self.backend.launch(plan)[0]
        except LaunchError as exc:
            self._unusable.add(machine)
            self.printer.note(f"cannot start {spec.name} to join the job: {exc}; the job goes on without "
                              f"{spec.host.label}")
            return
        self.printer.starting([spec.name])
        self.handles.append(handle)
        if self.observer is not None:
            self.observer.attach(self.handles)

    def _root_cause(self) -> Failure | None:
        """The first real failure: a lost server whose replica took its place is none, unless the job
        then failed for want of keys (its nodes ended, blaming a peer): then the last server or
        replica lost is, the one whose keys no process held any more."""
        lost = [h for h in self.handles if id(h) in self._lost_holders]
        first = culprit([h for h in self.handles if id(h) not in self._lost_holders | self._dropped], self._stopped)
        if lost and (first is None or kind_of(first.handle, self._stopped) == "peer"):
            last = max(lost, key=lambda h: h.ended or 0.0)
            return culprit([last], self._stopped) or first
        return first

    def _early_failure(self, handle: ProcessHandle, then: str) -> Failure:
        running = [h.spec.name for h in self.handles if h.spec.role == "worker" and h.status is None]
        still = f" ({', '.join(running)} still running)" if running else ""
        return Failure(f"{who(handle)} exited with code 0 before the workers finished{still}{then}", 1, handle)

    def _job_control(self) -> None:
        """Ctrl-Z: stop every process, then pslaunch itself; SIGCONT: continue them."""
        if self._suspend_asked:
            self._suspend_asked = False
            # The table leaves the screen first: a shell that ran pslaunch from a script has its
            # prompt out as soon as the script stopped, and the table must be gone before that.
            if self.observer is not None:
                self.observer.pause()
            running = [h for h in self.handles if h.poll() is None]
            for handle in running:
                handle.suspend()
            self._suspended = True
            self.printer.note(f"stopped {len(running)} process(es) of the job (SIGTSTP); `fg` or SIGCONT continues it")
            self.printer.flush()
            paused_at = time.monotonic()
            previous = signal.signal(signal.SIGTSTP, signal.SIG_DFL)
            try:
                # SIGTSTP lets the shell's job control see a stopped job; without a terminal
                # (an orphaned process group) the kernel would ignore it, so SIGSTOP there.
                os.kill(os.getpid(), signal.SIGTSTP if in_foreground() else signal.SIGSTOP)
            finally:
                signal.signal(signal.SIGTSTP, previous)
            self._paused += time.monotonic() - paused_at
        if self._resume_asked:
            self._resume_asked = False
            if not self._suspended:  # SIGCONT alone (timeout(1) sends one after its signal): nothing stopped
                return
            self._suspended = False
            for handle in self.handles:
                if handle.poll() is None:
                    handle.resume()
            if self.observer is not None:
                self.observer.resume()
            self.printer.note("job continued")

    def _teardown(self) -> None:
        """TERM (and CONT) everything still running, wait the grace period, KILL what is left."""
        for handle in self.handles:
            if handle.status is None:
                self._stopped.add(id(handle))
        hurry = len(self._signals)  # another Ctrl-C skips the grace period
        if self.config.elastic:
            # An elastic job's worker takes a first SIGTERM as a notice to leave at its next step boundary
            # (kvcore.leaving), which a job torn down never reaches: the second, below, ends it at once.
            for handle in self.handles:
                if handle.spec.role == "worker" and handle.poll() is None:
                    handle.terminate()
            time.sleep(0.05)  # two signals at once would be one
        # every handle: exited leaders may leave group members behind
        running = stop(self.handles, terminate=lambda h: h.terminate(), kill=lambda h: h.kill(),
                       alive=lambda h: h.poll() is None, grace=self.config.stop_grace,
                       hurry=lambda: len(self._signals) > hurry, tick=_TICK)
        deadline = time.monotonic() + max(2.0, self.config.stop_grace)
        while running and time.monotonic() < deadline:
            time.sleep(_TICK)
            running = [h for h in running if h.poll() is None]
        for handle in running:
            if handle.in_doubt():  # its host went quiet: the signals may never have got there
                handle.unreachable = True
                self.printer.note(f"{who(handle)} is unreachable: no word from its host for a while "
                                  f"(its guard stops it there after --link-timeout {self.config.link_timeout:g} s)")
            else:
                self.printer.note(f"{who(handle)} did not end after SIGKILL")

    # -- reporting -----------------------------------------------------------------------------
    def _table(self) -> tuple[list[ProcessHandle], dict[int, str]]:
        """The summary table's processes (a worker restarted alone: its earlier runs first) and notes."""
        shown: list[ProcessHandle] = []
        for handle in self.handles:
            shown += [r for r in self._replaced if r.spec.name == handle.spec.name]
            shown.append(handle)
        table_notes = notes(shown, self._stopped, self.failure)
        table_notes.update({id(r): "failed; restarted alone" for r in self._replaced})
        table_notes.update({i: "lost; dropped from the elastic job" for i in self._dropped})
        for handle in shown:
            if id(handle) in self._lost_holders and (self.failure is None or self.failure.handle is not handle):
                table_notes[id(handle)] = ("failed; its server went on" if handle.spec.role == "replica"
                                           else "failed; a replica took its place")
        waited = {record.new_pid: record.waited_s for record in self.replacements.records()}
        for handle in shown:
            if handle.pid in waited and not table_notes.get(id(handle)):
                wait = waited[handle.pid]
                if handle.spec.role == "scheduler":
                    table_notes[id(handle)] = "replacement" + ("" if wait is None else f"; nodes back after {wait:.1f}s")
                elif self._held_elsewhere(handle):
                    table_notes[id(handle)] = "replica again" + ("" if wait is None else f", its keys after {wait:.1f}s")
                else:
                    table_notes[id(handle)] = "replacement" + ("" if wait is None else f"; the others waited {wait:.1f}s")
        return shown, table_notes

    def result(self) -> "RunResult":
        """The job's outcome for a program (``launcher.api``): what ``_report`` prints, as data."""
        shown, table_notes = self._table()
        return result_of(shown, table_notes, self.failure, self.printer.last_lines, self.restarts.attempts,
                         self.replacements.records())

    def _report(self, then: str | None = None) -> None:
        """The summary table, the root cause and its last lines; ``then``: the job goes on (a restart),
        else the attempts (with restarts) and the exit code end it."""
        if self.observer is not None and then is None:
            shown, by_id = self._table()  # the table's notes (a replacement's, a dropped worker's) as printed
            self.observer.finish({h.spec.name: by_id.get(id(h), "") for h in shown}, self.failure,
                                 0 if self.failure is None else self.failure.exit_code, self.restarts.attempts,
                                 self.replacements.records())
        if then is None and self.handles and self._plan is not None:
            for note in self._plan.notes:  # what pslaunch chose for the job (threads), once, with the summary:
                self.printer.note(note)    # never before a failing worker's traceback
        if self.handles and (not self.config.quiet or self.config.log_dir):  # quiet: the log dir's copy only
            from .summary import render_summary

            table = render_summary(*self._table(), self.printer.colour)
            if self.config.quiet:
                self.printer.record(table)
            else:
                self.printer.raw(table)
        if self.failure is not None:
            # a restart follows: pslaunch does not exit, so its exit code's note would mislead
            self.printer.note(f"root cause: {self.failure.reason if then is not None else self.failure.final_reason}")
            if self.failure.handle is not None:
                name = self.failure.handle.spec.name
                lines = self.failure.quoted or self.printer.last_lines(name)
                if lines:
                    self.printer.note(f"Python stack of {name}'s main thread (innermost call first):"
                                      if self.failure.quoted else f"last lines of {name}:")
                    for text in lines:
                        self.printer.note(f"  | {text}")
                else:
                    self.printer.note(f"{name} printed nothing")
        if then is not None:
            self.printer.note(then)
        else:
            if self.restarts.used:
                for line in self.restarts.render():
                    self.printer.note(line)
            for line in self.replacements.lines():
                self.printer.note(line)
            if self.failure is not None:
                self.printer.note(f"exit code {self.failure.exit_code}")
        self.printer.flush()
