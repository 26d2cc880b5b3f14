"""The training examples survive failures as docs/failures.md promises: a worker killed from outside
under ``--restart-scope worker`` is replaced in place, and a job restarted from its last epoch's
checkpoint (``--restart-scope job --checkpoint-dir``) goes on from there; either way worker 0's final
weights (``--save-weights``) equal an uninterrupted run's, bit for bit. Real pslaunch jobs, killed with
SIGKILL when a worker has printed a given epoch."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from testkit.launcher import PSLAUNCH, job_worker, reaped, wait_gone

ROOT = Path(__file__).resolve().parent.parent
MLP = [str(ROOT / "examples" / "train_mlp.py"), "--epochs", "12", "--hidden", "1024"]
JOB = ["-n", "2", "-s", "2", "--no-dashboard", "--env", "OMP_NUM_THREADS:1", "--timeout", "150"]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "PS_", "PSLAUNCH_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def _run(tmp_path: Path, name: str, options: list[str], kills: dict[str, int],
         how: signal.Signals = signal.SIGKILL) -> tuple[str, Path]:
    """Run the MLP example under pslaunch ``options``; send worker ``rank`` ``how`` (SIGKILL) once an
    output line matches each pattern of ``kills``, once each. Returns pslaunch's output and the weights' file."""
    weights = tmp_path / f"{name}.npz"
    proc = subprocess.Popen([*PSLAUNCH, *JOB, *options, sys.executable, *MLP, "--save-weights", str(weights)],
                            cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines: list[str] = []
    pending = dict(kills)

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            for pattern, rank in list(pending.items()):
                if re.search(pattern, line):
                    del pending[pattern]
                    deadline = time.monotonic() + 10
                    while (pid := job_worker(str(weights), rank)) is None and time.monotonic() < deadline:
                        time.sleep(0.02)
                    if pid is not None:
                        os.kill(pid, how)
    reader = threading.Thread(target=read, daemon=True)
    with reaped(proc, str(weights)):
        reader.start()
        proc.wait(timeout=200)
        reader.join(10)
    output = "".join(lines)
    assert proc.returncode == 0, output[-5000:]
    assert not pending, f"never saw {list(pending)}:\n{output[-5000:]}"
    assert not wait_gone(str(weights))
    return output, weights


def _same(a: Path, b: Path) -> bool:
    with np.load(a) as x, np.load(b) as y:
        return x.files == y.files and all(np.array_equal(x[k], y[k]) for k in x.files)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    return _run(tmp_path_factory.mktemp("uninterrupted"), "uninterrupted", [], {})[1]


def test_workers_of_the_mlp_example_killed_from_outside_are_replaced_in_place_with_the_same_final_weights(
        tmp_path, uninterrupted):
    output, weights = _run(tmp_path, "replaced", ["--max-restarts", "3", "--restart-scope", "worker"],
                           {r"worker 1 epoch 2 ": 1, r"worker 0 epoch 6 ": 0})
    assert _same(weights, uninterrupted), "the final weights differ from the uninterrupted run's"
    assert output.count("the other processes go on") == 2, output
    # each replacement resumed from its predecessor's last mark, inside the epoch it died in
    resumed = re.findall(r"worker\.(\d)@\S+ replaced in place at .*resumed from its predecessor's last mark "
                         r"\(epoch=(\d+), step=(\d+)\)", output)
    assert [rank for rank, _, _ in resumed] == ["1", "0"], output
    # killed once epochs 2 and 6 had printed: a mark is sent with the next push, so a replacement may
    # resume at the end of that epoch (and redo its last steps), never before it
    assert int(resumed[0][1]) >= 2 and int(resumed[1][1]) >= 6, output
    assert "restarting the job" not in output


def test_the_mlp_example_restarted_as_a_job_goes_on_from_its_last_epochs_checkpoint_with_the_same_final_weights(
        tmp_path, uninterrupted):
    output, weights = _run(tmp_path, "restarted", ["--max-restarts", "1", "--checkpoint-dir", str(tmp_path / "ckpt")],
                           {r"worker 1 epoch 4 ": 1})
    assert _same(weights, uninterrupted), "the final weights differ from the uninterrupted run's"
    assert "restarting the job (restart 1 of 1" in output, output
    # the restarted job printed no epoch before the checkpoint it resumed from: it went on from there
    restarted = output.split("restarting the job", 1)[1]
    epochs = sorted({int(e) for e in re.findall(r"worker 0 epoch (\d+) ", restarted)})
    assert epochs and epochs[0] >= 4 and epochs[-1] == 11, output


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL], ids=["leaves", "is-lost"])
def test_the_mlp_example_in_an_elastic_job_goes_on_when_a_worker_leaves_or_is_lost(tmp_path, how):
    # -n 2:3: three start; worker 2 gets SIGTERM (it leaves at a step boundary) or SIGKILL (dropped) in
    # epoch 4; workers 0 and 1 finish every epoch with the same weights (each epoch split over each
    # step's members, each step the mean over them)
    output, _ = _run(tmp_path, "elastic", ["-n", "2:3"], {r"worker 2 epoch 3 ": 2}, how)
    finals = re.findall(r"worker (\d) final test_accuracy (\S+)", output)
    assert sorted(rank for rank, _ in finals) == ["0", "1"] and finals[0][1] == finals[1][1], output[-3000:]
    for epoch in range(12):
        seen = set(re.findall(rf"worker [01] epoch {epoch} test_accuracy (\S+)", output))
        assert len(seen) == 1, (epoch, seen)  # both hold the same weights after every epoch
    said = ("worker 2 left the job at a step boundary (SIGTERM)" if how == signal.SIGTERM
            else "was lost: signal SIGKILL; the elastic job drops it")
    assert said in output, output[-3000:]
