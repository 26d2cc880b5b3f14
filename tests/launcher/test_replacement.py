"""A dist_sync worker replaced in place (``--restart-scope worker``): the worker that dies is started
again alone, with its rank, resumes at its last mark (the scalars of kvcore.elastic.State) and redoes
its steps since then, while the scheduler, the servers and the other workers keep running. The
model's gradients depend on the weights each worker pulled, so the final weights equal those of an
uninterrupted run bit for bit only when every redone push is dropped, none is lost, and every
redone pull returns what the predecessor pulled (tests/launcher/helpers/replace_sync.py)."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import sys
import time

import pytest

from launcher import launch
from testkit.launcher import REPO, backend_launch, helper, live_processes, reaped, run_pslaunch, wait_gone
from testkit.launcher.outcome import same_weights, saved_weights, table_rows
from testkit.launcher.processes import start_pslaunch
from testkit.launcher.terminal import run_in_terminal

HELPER = helper("replace_sync.py")
ENV = ["--env", "PSLAUNCH_BIGARRAY_BOUND:1000"]  # key 0 is split over both servers
REPLACE = ["--max-restarts", "8", "--restart-scope", "worker"]  # no --checkpoint-dir: none is needed


def _job(out, *args, env=(), steps=12, timeout=120):
    env_args = [a for item in env for a in ("--env", item)]
    res = run_pslaunch(["-n", "2", "-s", "2", "--no-dashboard", *ENV, "--env", f"STEPS:{steps}", *env_args, *args,
                        "--timeout", str(timeout - 20), "python", HELPER, str(out)], timeout=timeout)
    assert not wait_gone(str(out)), f"processes of the job in {out} outlived it"
    return res


def _starts(out):
    """``(rank, restart count, resumed step)`` of every worker start, in order."""
    return [tuple(int(x) for x in line.split()) for line in (out / "starts.txt").read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The weights of uninterrupted runs, by number of steps."""
    found = {}

    def of(steps=12):
        if steps not in found:
            out = tmp_path_factory.mktemp(f"uninterrupted{steps}")
            res = _job(out, steps=steps)
            assert res.returncode == 0, res.stderr
            found[steps] = saved_weights(out)
        return found[steps]
    return of


def _resumed_as_expected(out, kills: str) -> None:
    """Each kill ``rank:step:phase`` was followed by a start of that rank that resumed at that step or
    the one before: a worker marks its place (``state.step = step + 1``) with its next push, so a mark
    may not have left when it died (its replacement then redoes one step more)."""
    restarts = [s for s in _starts(out) if s[1] > 0]
    assert sorted(count for _, count, _ in restarts) == list(range(1, len(kills.split(",")) + 1)), restarts
    for rank in (0, 1):
        resumed = [step for r, _, step in sorted(restarts, key=lambda s: s[1]) if r == rank]
        killed = [int(k.split(":")[1]) for k in kills.split(",") if k.startswith(f"{rank}:")]
        # killed in the set-up (step -1): its replacement begins at step 0
        assert len(resumed) == len(killed) and all(k - 1 <= s <= max(k, 0) for s, k in zip(resumed, killed)), \
            (restarts, kills)


@pytest.mark.parametrize("kills", [
    "1:4:push",  # mid-push: half of the step's keys reached the servers
    "0:0:compute",  # worker 0, before its first push: it placed the keys and shipped the optimizer
    "0:5:pulled,1:7:pull",  # after the pulls, before the mark; mid-pull
    "0:2:marked,0:3:pushed,1:9:pull",  # the mark never left; twice in a row
    "1:6:pushed,0:6:pushed",  # both workers in one step
    "0:11:marked",  # the last step: the replacement redoes it
    "0:-1:init",  # worker 0 before its init or optimizer reached the servers: its replacement sends them
    "0:-1:optimizer,1:-1:first-pull",  # both in the set-up, before any mark
], ids=["mid-push", "worker-0-first-step", "two-workers", "three-kills", "same-step", "last-step", "worker-0-init",
        "set-up"])
def test_a_killed_dist_sync_worker_is_replaced_alone_and_the_weights_are_bit_equal(tmp_path, reference, kills):
    res = _job(tmp_path, *REPLACE, env=[f"KILLS:{kills}"])
    assert res.returncode == 0, res.stderr
    assert same_weights(saved_weights(tmp_path), reference()), "the weights differ from the uninterrupted run's"
    _resumed_as_expected(tmp_path, kills)
    resumed = kills.split(",")
    rows = table_rows(res.stderr)
    # the scheduler, the servers: one run each, never restarted; a killed worker's runs end in SIGKILL
    assert sorted((r[0], r[1]) for r in rows if r[0] != "worker") == [("scheduler", "0"), ("server", "0"), ("server", "1")]
    assert all(r[3] == "0" and r[4] == "" for r in rows if r[0] != "worker"), rows
    for rank in ("0", "1"):
        runs = [r for r in rows if r[:2] == ("worker", rank)]
        assert [r[3] for r in runs] == ["signal SIGKILL"] * (len(runs) - 1) + ["0"], rows
    assert res.stderr.count("the other processes go on") == len(resumed)


@pytest.mark.parametrize("kills", ["1:3:pulled,0:5:push", "0:-1:optimizer"])
def test_a_replacement_that_sets_its_optimizer_after_restoring_redoes_that_barrier_by_its_predecessors_number(
        tmp_path, reference, kills):
    # kvcore.Trainer sets the optimizer at its first step: after state.restore(), so after the barrier
    # counts jumped to the mark's; its barrier is redone by the number its predecessor's had (once, it hung)
    res = _job(tmp_path, *REPLACE, env=["OPTIMIZER_LATE:1", f"KILLS:{kills}"], timeout=60)
    assert res.returncode == 0, res.stderr
    assert same_weights(saved_weights(tmp_path), reference())
    _resumed_as_expected(tmp_path, kills)


def test_a_dist_device_sync_worker_is_replaced_in_place_too(tmp_path, reference):
    # merged on the device (CuPy, or numpy where there is no GPU) before the push: the same rounds
    res = _job(tmp_path, *REPLACE, env=["STORE:dist_device_sync", "KILLS:1:3:push,0:6:pulled"])
    assert res.returncode == 0, res.stderr
    assert same_weights(saved_weights(tmp_path), reference())
    _resumed_as_expected(tmp_path, "1:3:push,0:6:pulled")


def test_barriers_and_commits_a_replacement_redoes_are_answered_at_once_and_no_checkpoint_is_written_twice(
        tmp_path, reference):
    # worker 0 dies right after a commit (its mark is sent with its next push, so it redoes the step and
    # the commit: the checkpoint its predecessor wrote stays, written once); worker 1 after a barrier
    ckpt = tmp_path / "ckpt"
    res = _job(tmp_path, *REPLACE, "--checkpoint-dir", str(ckpt),
               env=["COMMIT_EVERY:3", "BARRIER_EVERY:2", "KILLS:0:2:commit,1:3:barrier,1:8:commit"])
    assert res.returncode == 0, res.stderr
    assert same_weights(saved_weights(tmp_path), reference())
    _resumed_as_expected(tmp_path, "0:2:commit,1:3:barrier,1:8:commit")
    assert sorted(p.name for p in ckpt.iterdir()) == ["ckpt-00000003", "ckpt-00000004"]  # 4 commits, each once
    manifest = json.loads((ckpt / "ckpt-00000004" / "MANIFEST.json").read_text())
    assert manifest["scalars"] == {"step": 12}


def test_workers_killed_from_outside_at_random_moments_end_with_the_uninterruptedsaved_weights(tmp_path, reference):
    # SIGKILL from outside, at random moments of a running job (mid-push, mid-pull, between steps: wherever
    # it lands), four times, any rank; the seed is in the failure message
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    steps = 40
    proc = start_pslaunch(["-n", "2", "-s", "2", "--no-dashboard", *ENV, *REPLACE, "--env", f"STEPS:{steps}",
                           "--env", "STEP_SLEEP:0.02", "--timeout", "100", "python", HELPER, str(tmp_path)])
    killed = []
    with reaped(proc, str(tmp_path)):
        deadline = time.monotonic() + 60
        while len(killed) < 4 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(rng.uniform(0.15, 0.6))
            workers = _worker_pids(str(tmp_path))
            if len(workers) == 2:  # both running: neither is a replacement still starting
                pid = rng.choice(workers)
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
        _, err = proc.communicate(timeout=110)
    stderr = err.decode()
    assert not wait_gone(str(tmp_path))
    assert proc.returncode == 0, f"seed {seed}, killed {killed}:\n{stderr}"
    assert len(killed) >= 2, f"seed {seed}: the job ended before the kills ({killed})"
    assert same_weights(saved_weights(tmp_path), reference(steps)), f"seed {seed}, killed {killed}: the weights differ\n{stderr}"
    # each kill is a replacement, but one that landed after that worker's finish (its part was done)
    done = stderr.count("ended after its part was done")
    assert stderr.count("the other processes go on") == len(killed) - done and done <= 1, stderr


@pytest.mark.parametrize("restarts", [REPLACE, []], ids=["restart-scope-worker", "no-restarts"])
def test_a_worker_killed_after_its_part_was_done_is_not_replaced_and_the_job_succeeds(tmp_path, reference, restarts):
    # SIGKILL once kv.close() returned: the scheduler had its finish, so no round waits for it and a
    # replacement would find the job ending (once, it was started and the job failed "scheduler exited 0")
    res = _job(tmp_path, *restarts, env=["KILLS:1:12:closed"])
    assert res.returncode == 0, res.stderr
    assert same_weights(saved_weights(tmp_path), reference())
    assert sorted(_starts(tmp_path)) == [(0, 0, 0), (1, 0, 0)], "a worker was started again"
    assert re.search(r"pslaunch: worker\.1@\S+ \(worker rank 1 .*\) ended after its part was done \(signal SIGKILL\): "
                     r"the scheduler had its finish, so nothing waits for it and it is not replaced", res.stderr), res.stderr
    rows = table_rows(res.stderr)
    assert [r for r in rows if r[:2] == ("worker", "1")][0][3:] == ("signal SIGKILL", "ended after its part was done"), rows
    assert "root cause" not in res.stderr and "restarting" not in res.stderr


def test_a_worker_error_after_its_part_was_done_is_still_the_jobs_failure(tmp_path):
    # its own error is no kill from outside: what the script does after kv.close() failed, and the job says so
    res = _job(tmp_path, *REPLACE, env=["FAIL_AFTER_CLOSE:1"])
    assert res.returncode == 1, res.stderr
    assert re.search(r"root cause: worker\.1@\S+ \(worker rank 1 .*\) failed first", res.stderr), res.stderr
    assert "RuntimeError: worker 1 failed after its part was done" in res.stderr
    assert "restarting it alone" not in res.stderr and len(_starts(tmp_path)) == 2


def _worker_pids(marker: str) -> list[int]:
    """The pids of the job's live worker processes (the helper's, with ``marker`` in their argv)."""
    # python HELPER OUTDIR: not pslaunch, whose argv holds them too
    return [p.pid for p in live_processes() if list(p.argv[1:3]) == [HELPER.encode(), marker.encode()]]


def test_without_a_checkpoint_a_lost_server_ends_the_job_instead_of_starting_it_from_scratch(tmp_path):
    # --restart-scope worker needs no checkpoint directory; a server's failure then cannot be survived
    # (the servers hold the model): the job stops, naming why, rather than training again from step 0
    proc = start_pslaunch(["-n", "2", "-s", "2", "--no-dashboard", *ENV, *REPLACE, "--env", "STEPS:400",
                           "--env", "STEP_SLEEP:0.02", "--timeout", "60", "python", HELPER, str(tmp_path)])
    with reaped(proc, str(tmp_path)):
        deadline = time.monotonic() + 30
        while not (tmp_path / "starts.txt").exists() or len(_starts(tmp_path)) < 2:
            assert time.monotonic() < deadline and proc.poll() is None, "the job did not start"
            time.sleep(0.1)
        servers = [pid for pid, argv in _children(proc.pid) if b"server" in argv and b"psnode" in argv]
        assert len(servers) == 2, _children(proc.pid)
        os.kill(servers[0], signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
    stderr = err.decode()
    assert proc.returncode == 137, stderr  # the server's own end is the exit code
    assert re.search(r"pslaunch: server\.0@\S+ \(server rank 0 .*\) failed first: signal SIGKILL: without "
                     r"--checkpoint-dir only a failed worker is restarted \(alone, --restart-scope worker\); the job is "
                     r"not started again", stderr), stderr
    assert "restarting the job" not in stderr
    assert not wait_gone(str(tmp_path))


def _children(parent: int) -> list[tuple[int, list[bytes]]]:
    """``(pid, argv)`` of ``parent``'s live child processes."""
    return [(p.pid, list(p.argv)) for p in live_processes() if p.ppid == parent]


def test_a_script_that_marks_nothing_cannot_be_redone_exactly_and_its_replacement_says_why(tmp_path):
    res = _job(tmp_path, "--max-restarts", "1", "--restart-scope", "worker", env=["NO_STATE:1", "KILLS:1:4:push"])
    assert res.returncode == 1, res.stderr
    assert re.search(r"a pull of round 0 cannot be answered exactly, this server keeps round \d+ only: a worker "
                     r"replaced in place resumes from its last mark \(the scalars of kvcore.elastic.State", res.stderr)


def test_each_replacement_is_in_the_run_result_the_summary_json_the_table_and_the_summary_lines(tmp_path):
    # through the Python API as a user calls it: which process, when, from which mark, how long the others waited
    summary = tmp_path / "summary.json"
    result = launch([sys.executable, HELPER, str(tmp_path)], num_workers=2, num_servers=2, max_restarts=4,
                    restart_scope="worker", summary_json=str(summary), timeout=60, quiet=False,
                    env={"PSLAUNCH_BIGARRAY_BOUND": "1000", "STEPS": "12", "STEP_SLEEP": "0.02",
                         "KILLS": "1:4:push,0:7:pulled"})
    assert result.ok, result.root_cause
    assert not wait_gone(str(tmp_path))
    first, second = result.replacements
    assert (first.process, first.rank, second.process, second.rank) == ("worker.1@localhost", 1, "worker.0@localhost", 0)
    starts = {(rank, count): step for rank, count, step in _starts(tmp_path)}
    for record in (first, second):
        runs = [p for p in result.processes if p.name == record.process]
        assert [(p.pid, p.signal, p.exit_code) for p in runs] == [(record.old_pid, signal.SIGKILL, None),
                                                                 (record.new_pid, None, 0)], result.processes
        assert record.ended == "signal SIGKILL" and record.restart in (1, 2)
        # the scalars it resumed from are those the script restored (its starts.txt line)
        assert record.resumed_from == {"step": starts[(record.rank, record.restart)]}, (record, starts)
        assert 0 < record.ended_s <= record.started_s <= record.resumed_s <= record.caught_up_s, record
        assert record.waited_s == round(record.caught_up_s - record.ended_s, 3) and 0 < record.waited_s < 20, record
        note = next(p.note for p in result.processes if p.pid == record.new_pid)
        assert note == f"replacement; the others waited {record.waited_s:.1f}s", result.processes
    assert first.ended_s < second.ended_s and [first.restart, second.restart] == [1, 2]
    document = json.loads(summary.read_text())
    assert document["ok"] and document["replacements"] == [first.as_dict(), second.as_dict()], document
    assert document["replacements"][0]["waited_s"] == first.waited_s
    # what being ready for replacements costs the servers: the values since the oldest kept mark
    servers = [p for p in document["processes"] if p["role"] == "server"]
    assert all(0 < p["kept_bytes"] <= 3 * p["held_bytes"] for p in servers), servers


def test_a_job_without_replacements_keeps_no_earlier_values(tmp_path):
    summary = tmp_path / "summary.json"
    res = _job(tmp_path, "--summary-json", str(summary))
    assert res.returncode == 0, res.stderr
    servers = [p for p in json.loads(summary.read_text())["processes"] if p["role"] == "server"]
    assert [p["kept_bytes"] for p in servers] == [0, 0] and all(p["held_bytes"] > 0 for p in servers), servers


def test_the_replacement_lines_end_the_commands_report(tmp_path):
    res = _job(tmp_path, *REPLACE, env=["KILLS:1:3:pulled"])
    assert res.returncode == 0, res.stderr
    line = re.search(r"^pslaunch: worker\.1@localhost replaced in place at ([\d.]+) s \(signal SIGKILL; pid (\d+) -> "
                     r"(\d+), restart 1\): resumed from its predecessor's last mark \(step=(\d)\) ([\d.]+) s after the "
                     r"end; the others waited ([\d.]+) s for it$", res.stderr, re.M)
    assert line, res.stderr
    rows = [r for r in table_rows(res.stderr) if r[:2] == ("worker", "1")]
    assert [(r[2], r[3]) for r in rows] == [(line[2], "signal SIGKILL"), (line[3], "0")], rows
    assert rows[1][4] == f"replacement; the others waited {float(line[6]):.1f}s"
    assert int(line[4]) in (2, 3)


def test_the_live_table_in_a_terminal_names_the_replaced_worker_and_how_long_the_others_waited(tmp_path, marker):
    if shutil.which("tmux") is None:
        pytest.fail("tmux is missing: run scripts/test.sh (it installs tmux)")
    socket_name = f"pslaunch-{marker}"
    script = tmp_path / "job.sh"
    out = tmp_path / marker
    out.mkdir()
    script.write_text(
        f"cd {REPO}\nexport PYTHONPATH={REPO}\n"
        f"{sys.executable} -m launcher.cli -n 2 -s 2 {' '.join(ENV)} {' '.join(REPLACE)} --env STEPS:60 "
        f"--env STEP_SLEEP:0.1 --env KILLS:1:5:push --timeout 90 {sys.executable} {HELPER} {out}\necho EXIT=$?\n")
    seen, screen = run_in_terminal(script, socket_name, r"replaced: worker\.1 at 0:0\d \(the others waited (\d+\.\d) s\)")
    assert seen, f"the live table never named the replacement:\n{screen}"
    assert "EXIT=0" in screen, screen
    assert f"the others waited {seen[1]} s for it" in " ".join(screen.split()), screen
    assert not wait_gone(str(out))


def test_a_worker_is_replaced_in_place_on_its_own_host_over_ssh(request, tmp_path, reference):
    # the replacement starts on its own host (127.0.0.3), through its guard; the servers, the scheduler
    # and the other worker go on
    launch = backend_launch("ssh", request, tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    res = launch.run(["-n", "2", "-s", "2", "--no-dashboard", *launch.args, *ENV, *REPLACE, "--env", "STEPS:12",
                      "--env", "KILLS:1:4:push,0:7:pulled", "--timeout", "100", sys.executable, HELPER, str(out)],
                     timeout=150)
    assert res.returncode == 0, res.stderr
    assert same_weights(saved_weights(out), reference()), "the weights differ from the uninterrupted run's"
    _resumed_as_expected(out, "1:4:push,0:7:pulled")
    assert res.stderr.count("the other processes go on") == 2, res.stderr
    assert not wait_gone(str(out))


@pytest.mark.parametrize("backend", ["slurm", "sge"])
def test_a_batch_scheduler_refuses_replacement_in_place_before_anything_starts(backend, request, tmp_path):
    # every process is a task of one job holding its slots: a task started again alone would wait for them
    launch = backend_launch(backend, request, tmp_path)
    res = launch.run(["-n", "2", "-s", "1", *launch.args, *REPLACE, "python", HELPER, str(tmp_path)], timeout=60)
    assert res.returncode == 2, res.stderr
    assert f"--restart-scope worker cannot be used with --launcher {backend}: every process is a task of one" in res.stderr
