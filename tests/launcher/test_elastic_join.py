"""Workers joining a running elastic job (``-n MIN:MAX``; ``PSLAUNCH_START_WORKERS`` below
``DMLC_NUM_WORKER``): a worker that registers while the job runs takes the lowest free rank, the
servers agree the round it counts from, it gets the members' ``State`` scalars and goes on from their
step; nothing stops, and every ``dist_sync`` round sums exactly its members."""

from __future__ import annotations

import json
import re

import pytest

from testkit.launcher import REPO, helper, reaped, run_pslaunch, start_pslaunch, wait_gone
from testkit.launcher.elastic import ByHandJob, check_exact, lines, records, wait_for

pytestmark = pytest.mark.timeout(120)

HELPER = helper("elastic_join.py")


def test_a_worker_started_by_hand_joins_leaves_and_another_takes_its_rank_and_every_round_is_exact(tmp_path):
    # DMLC_NUM_WORKER=3 ranks, 2 start (PSLAUNCH_START_WORKERS), minimum 2: worker 2 joins once step 3
    # is done, leaves after its 6th step's pulls (its 7th is its last: counted from where it joined,
    # however long a loaded machine took to start it), and a second joiner takes rank 2 three steps
    # after (the 80 steps leave it about 4 s to start a process)
    steps = 80
    with ByHandJob(HELPER, tmp_path, DMLC_NUM_SERVER="2", DMLC_NUM_WORKER="3", PSLAUNCH_MIN_WORKERS="2",
                   PSLAUNCH_START_WORKERS="2", STEPS=str(steps), STEP_SLEEP="0.08") as job:
        for name, role in (("scheduler", "scheduler"), ("server0", "server"), ("server1", "server"),
                           ("worker0", "worker"), ("worker1", "worker")):
            job.start(name, role)
        wait_for(lambda: len(lines(tmp_path, 0)) >= 4)
        first = job.start("joiner1", "worker", LEAVE="2:+6")
        assert first.wait(timeout=60) == 0, job.logs()
        joined_first = [int(line.split()[2]) for line in lines(tmp_path, 2) if line.startswith("2 joined")]
        assert len(joined_first) == 1, (joined_first, job.logs())
        left = joined_first[0] + 7  # the first step without it
        wait_for(lambda: records(tmp_path) and max(records(tmp_path)) >= left + 3)
        job.start("joiner2", "worker")
        wait_for(lambda: sum(line.startswith("2 joined") for line in lines(tmp_path, 2)) == 2,
                 explain=lambda: f"{lines(tmp_path, 2)[-3:]} {job.logs()}")
        full = job.start("joiner3", "worker")  # the job holds its maximum of 3 workers now
        assert full.wait(timeout=60) != 0
        codes = [p.wait(timeout=60) for p in job.procs if p is not full]
    logs = job.logs()
    assert codes == [0] * len(codes), logs
    members = check_exact(records(tmp_path), steps)
    with_joiner = [step for step, m in enumerate(members) if m == {0, 1, 2}]
    joined = [int(line.split()[2]) for line in lines(tmp_path, 2) if line.startswith("2 joined")]
    # the first joiner came after step 3 and took part in 7 steps (SIGTERM after its 6th's pulls), the
    # second from where it restored the members' step on
    assert len(joined) == 2 and 4 <= joined[0] and joined[1] > left, joined
    assert with_joiner == list(range(joined[0], left)) + list(range(joined[1], steps)), (joined, with_joiner)
    assert all(m == {0, 1} for step, m in enumerate(members) if step not in with_joiner)
    for rank in (0, 1):  # the reset callbacks ran at exactly the steps where the count changed
        resets = (tmp_path / f"resets.{rank}.txt").read_text().split("\n")
        assert resets[:3] == [f"{rank} reset {joined[0]} 3", f"{rank} reset {left} 2", f"{rank} reset {joined[1]} 3"]
    assert "the job has its maximum of 3 workers (DMLC_NUM_WORKER, -n MIN:MAX)" in logs["joiner3"], logs["joiner3"]
    scheduler = logs["scheduler"]
    assert scheduler.count("worker 2 joined the job from 127.0.0.1:") == 2, scheduler


def test_two_workers_that_join_from_the_same_round_each_count_the_other_from_their_first_step(tmp_path):
    # DMLC_NUM_WORKER=4, 2 start; both wait before the push of step 4 (GATE), so no round moves while
    # joiner 2 starts (its store is made before joiner 3 asks to join) and joiner 3 joins: both count
    # from the same round. Joiner 2 hears of joiner 3 before its State scalars come, so its first step
    # counts 4 members as every other member's does (it counted the 3 its store saw when made)
    steps = 12
    gate = tmp_path / "gate"
    with ByHandJob(HELPER, tmp_path, DMLC_NUM_SERVER="2", DMLC_NUM_WORKER="4", PSLAUNCH_MIN_WORKERS="2",
                   PSLAUNCH_START_WORKERS="2", STEPS=str(steps), GATE=f"4:{gate}") as job:
        for name, role in (("scheduler", "scheduler"), ("server0", "server"), ("server1", "server"),
                           ("worker0", "worker"), ("worker1", "worker")):
            job.start(name, role)
        wait_for(lambda: len(lines(tmp_path, 0)) >= 4 and len(lines(tmp_path, 1)) >= 4, 60,
                 lambda: str(job.logs()))  # steps 0..3 done: both wait at the gate
        job.start("joiner2", "worker")
        wait_for(lambda: list(tmp_path.glob("created.2.*")), 60, lambda: str(job.logs()))
        job.start("joiner3", "worker")
        wait_for(lambda: list(tmp_path.glob("created.3.*")), 60, lambda: str(job.logs()))
        gate.touch()
        codes = [p.wait(timeout=90) for p in job.procs]
    logs = job.logs()
    assert codes == [0] * len(codes), logs
    joined = {rank: [int(line.split()[2]) for line in lines(tmp_path, rank) if line.startswith(f"{rank} joined")]
              for rank in (2, 3)}
    assert joined[2] == joined[3] and len(joined[2]) == 1 and joined[2][0] > 4, (joined, logs)
    members = check_exact(records(tmp_path), steps)
    assert members == [{0, 1}] * joined[2][0] + [{0, 1, 2, 3}] * (steps - joined[2][0]), (members, logs)
    # joiner 2's reset callbacks ran as its first step began: its store was made with 3 members
    assert (tmp_path / "resets.2.txt").read_text().split("\n")[0] == f"2 reset {joined[2][0]} 4"


def _write(path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def test_a_job_grows_to_max_when_the_discovery_script_reports_slots_and_shrinks_when_they_go(sshd, tmp_path):
    # -n 2:4 over ssh: the script reports one slot on each of two hosts, then two (two workers join),
    # then one again (the two on the slots that went leave); the job never stops, every round is exact
    out = tmp_path / "out"
    out.mkdir()
    capacity = tmp_path / "capacity.txt"
    _write(capacity, "127.0.0.2:1\n127.0.0.3:1\n")
    runs = tmp_path / "runs.txt"
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\necho run >> {runs}\ncat {capacity}\n")
    script.chmod(0o755)
    summary = tmp_path / "summary.json"
    args = ["-n", "2:4", "-s", "2", "--host-discovery-script", str(script), *sshd.ssh_flags(), "--no-dashboard",
            "--summary-json", str(summary), "--env", f"PYTHONPATH:{REPO}", "--env", "STEPS:70", "--env",
            "STEP_SLEEP:0.1", "--timeout", "90", "python", HELPER, str(out)]
    with reaped(start_pslaunch(args), str(out)) as proc:
        wait_for(lambda: len(lines(out, 0)) >= 5)
        _write(capacity, "127.0.0.2:many\n")  # a bad answer: said once, the job keeps its hosts
        asked = runs.read_text().count("run")
        wait_for(lambda: runs.read_text().count("run") >= asked + 3)  # read twice at least
        _write(capacity, "127.0.0.2:2\n127.0.0.3:2\n")
        wait_for(lambda: any(len(m) == 4 for m in records(out).values()))
        grown = max(records(out))
        wait_for(lambda: max(records(out)) >= grown + 5)
        _write(capacity, "127.0.0.2:1\n127.0.0.3:1\n")
        _, err = proc.communicate(timeout=90)
    err = err.decode()
    assert proc.returncode == 0, err
    members = check_exact(records(out), 70)
    sizes = [len(m) for m in members]
    assert sizes[:5] == [2] * 5 and 4 in sizes and sizes[-1] == 2, sizes
    assert sizes == sorted(sizes[:sizes.index(4) + 1]) + sorted(sizes[sizes.index(4) + 1:], reverse=True), sizes
    assert "127.0.0.2 has a free slot (--host-discovery-script" in err and "to join the job" in err, err
    assert err.count("slots 'many' is not a number in 1..65535; the job keeps the hosts it had") == 1, err
    assert re.search(r"127\.0\.0\.\d has 1 slot now \(--host-discovery-script \S+\): worker\.\d@127\.0\.0\.\d leaves "
                     r"the job at its next step boundary \(SIGTERM\)", err), err
    rows = json.loads(summary.read_text())["processes"]
    joiners = [r for r in rows if r["note"].startswith("joined the running job")]
    assert len(joiners) == 2 and all("left the job at" in r["note"] and r["exit_code"] == 0 for r in joiners), rows
    assert not wait_gone(str(out))


def test_an_elastic_job_over_ssh_reads_its_hostfile_again_when_it_changes(sshd, tmp_path):
    # -n 1:2: one slot at the start; a second host appears in the hostfile (its worker joins), then goes
    out = tmp_path / "out"
    out.mkdir()
    hostfile = tmp_path / "hosts"
    _write(hostfile, "127.0.0.2 slots=1\n")
    args = ["-n", "1:2", "-s", "1", "-H", str(hostfile), *sshd.ssh_flags(), "--no-dashboard", "--env",
            f"PYTHONPATH:{REPO}", "--env", "STEPS:50", "--env", "STEP_SLEEP:0.1", "--timeout", "90", "python", HELPER,
            str(out)]
    with reaped(start_pslaunch(args), str(out)) as proc:
        wait_for(lambda: len(lines(out, 0)) >= 4)
        _write(hostfile, "127.0.0.2 slots=1\n127.0.0.3 slots=1\n")
        wait_for(lambda: any(len(m) == 2 for m in records(out).values()))
        grown = max(records(out))
        wait_for(lambda: max(records(out)) >= grown + 4)
        _write(hostfile, "127.0.0.2 slots=1\n")
        _, err = proc.communicate(timeout=90)
    err = err.decode()
    assert proc.returncode == 0, err
    sizes = [len(m) for m in check_exact(records(out), 50)]
    first, last = sizes.index(2), len(sizes) - sizes[::-1].index(2) - 1
    assert sizes == [1] * first + [2] * (last - first + 1) + [1] * (len(sizes) - last - 1) and sizes[-1] == 1, sizes
    assert f"127.0.0.3 has a free slot (the hostfile {hostfile}): starting worker.1@127.0.0.3 to join the job" in err
    assert f"127.0.0.3 is no longer listed (the hostfile {hostfile}): worker.1@127.0.0.3 leaves the job" in err
    assert not wait_gone(str(out))


def test_split_sampler_elastic_batches_take_every_index_of_an_epoch_once_while_workers_join_and_leave(tmp_path):
    # 2 start; a third joins during epoch 0 and leaves after its step 30's pulls (in epoch 2 or so): each
    # epoch's 90 indices are taken exactly once, each step by that step's members only

    def taken() -> list[tuple[int, int, int, int, int, list[int]]]:
        rows = []
        for path in tmp_path.glob("data.*.txt"):
            for line in path.read_text().splitlines():
                rank, epoch, step, members, total, indices = line.split(" ")
                rows.append((int(rank), int(epoch), int(step), int(members), int(total),
                             [int(i) for i in indices.split(",") if i]))
        return rows

    with ByHandJob(helper("elastic_data.py"), tmp_path, DMLC_NUM_SERVER="1", DMLC_NUM_WORKER="3",
                   PSLAUNCH_MIN_WORKERS="2", PSLAUNCH_START_WORKERS="2", EPOCHS="4", STEP_SLEEP="0.05") as job:
        for name, role in (("scheduler", "scheduler"), ("server", "server"), ("worker0", "worker"),
                           ("worker1", "worker")):
            job.start(name, role)
        wait_for(lambda: len(taken()) >= 6)
        job.start("joiner", "worker", LEAVE="2:+12")
        codes = [p.wait(timeout=90) for p in job.procs]
    assert codes == [0] * len(codes), job.logs()
    rows = taken()
    by_step: dict[int, list] = {}
    for row in rows:
        by_step.setdefault(row[2], []).append(row)
    sizes = []
    for step, seen in sorted(by_step.items()):
        ranks = sorted(r[0] for r in seen)
        assert all(r[3] == len(ranks) for r in seen), (step, seen)  # kv.num_workers: the step's members
        assert all(r[4] == sum(len(x[5]) for x in seen) for r in seen), (step, seen)  # the round summed them all
        sizes.append(len(ranks))
    assert 3 in sizes and sizes[0] == 2 and sizes[-1] == 2, sizes
    for epoch in range(4):
        indices = sorted(i for r in rows if r[1] == epoch for i in r[5])
        assert indices == list(range(90)), (epoch, indices)


def test_the_trainers_step_is_the_mean_over_each_steps_members_while_workers_join_and_leave(tmp_path):
    # 2 start; a third joins and leaves after its 8th step's pulls: SGD with learning rate 1 moves w by
    # minus the mean of (rank + 1) over each step's members, exactly, in every worker

    def rows() -> list[tuple[int, int, int, float]]:
        return [(int(a), int(b), int(c), float(d)) for path in tmp_path.glob("trainer.*.txt")
                for a, b, c, d in (line.split() for line in path.read_text().splitlines())]

    with ByHandJob(helper("elastic_trainer.py"), tmp_path, DMLC_NUM_SERVER="1", DMLC_NUM_WORKER="3",
                   PSLAUNCH_MIN_WORKERS="2", PSLAUNCH_START_WORKERS="2", STEPS="24", STEP_SLEEP="0.08") as job:
        for name, role in (("scheduler", "scheduler"), ("server", "server"), ("worker0", "worker"),
                           ("worker1", "worker")):
            job.start(name, role)
        wait_for(lambda: len(rows()) >= 6)
        job.start("joiner", "worker", LEAVE="2:+8")
        codes = [p.wait(timeout=90) for p in job.procs]
    assert codes == [0] * len(codes), job.logs()
    by_step: dict[int, dict[int, tuple[int, float]]] = {}
    for rank, step, members, w in rows():
        by_step.setdefault(step, {})[rank] = (members, w)
    expected, sizes = 0.0, []
    for step in range(24):
        seen = by_step[step]
        expected -= sum(rank + 1 for rank in seen) / len(seen)
        assert all(m == len(seen) and w == pytest.approx(expected, rel=1e-12) for m, w in seen.values()), (step, seen)
        sizes.append(len(seen))
    assert 3 in sizes and sizes[0] == 2 and sizes[-1] == 2, sizes


def test_a_trainer_that_sums_among_the_workers_is_refused_in_an_elastic_job(tmp_path):
    res = run_pslaunch(["-n", "1:2", "-s", "1", "--no-dashboard", "--env", "ON_STORE:0", "--timeout", "60", "python",
                        helper("elastic_trainer.py"), str(tmp_path)], timeout=90)
    assert res.returncode != 0
    assert ("Trainer(update_on_kvstore=False) sums the gradients among the workers with collectives, whose groups do "
            "not follow an elastic job's members (-n MIN:MAX)") in res.stderr, res.stderr


def test_a_worker_started_by_hand_with_a_rank_no_one_held_yet_joins_as_that_rank(tmp_path):
    # DMLC_NUM_WORKER=4, 2 start: a worker that asks for rank 3 (DMLC_WORKER_ID) joins as worker 3
    with ByHandJob(HELPER, tmp_path, DMLC_NUM_SERVER="1", DMLC_NUM_WORKER="4", PSLAUNCH_MIN_WORKERS="2",
                   PSLAUNCH_START_WORKERS="2", STEPS="30", STEP_SLEEP="0.05") as job:
        for name, role in (("scheduler", "scheduler"), ("server", "server"), ("worker0", "worker"),
                           ("worker1", "worker")):
            job.start(name, role)
        wait_for(lambda: len(lines(tmp_path, 0)) >= 3)
        job.start("joiner", "worker", DMLC_WORKER_ID="3")
        codes = [p.wait(timeout=60) for p in job.procs]
    assert codes == [0] * 5, job.logs()
    members = check_exact(records(tmp_path), 30)
    assert {0, 1, 3} in members and all(m in ({0, 1}, {0, 1, 3}) for m in members), members
