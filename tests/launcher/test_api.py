"""pslaunch from Python: launch() runs a real job as the command does and returns a RunResult; it
prints nothing unless asked, raises the launcher's errors for what it refuses before starting, and a
failed job is a result naming its root cause, not an exception."""

from __future__ import annotations

import sys

import pytest

from launcher import ConfigError, JobFailed, RunResult, launch
from testkit.launcher import helper


def test_a_job_that_succeeds_returns_a_row_per_process_and_prints_nothing(capfd, tmp_path):
    result = launch([sys.executable, "-c", "import kvcore; kvcore.create('dist_sync').barrier(); print('hi')"],
                    num_workers=2, num_servers=1, log_dir=str(tmp_path / "logs"))
    assert isinstance(result, RunResult) and result.ok and result.exit_code == 0 and result.root_cause is None
    assert [(p.role, p.rank, p.exit_code) for p in result.processes] == [
        ("scheduler", 0, 0), ("server", 0, 0), ("worker", 0, 0), ("worker", 1, 0)]
    assert all(p.pid and p.duration_s > 0 for p in result.processes)
    assert result.check() is result and result.process("worker.1").note == ""
    out, err = capfd.readouterr()
    assert out == "" and err == ""  # quiet: nothing on this process's streams
    assert "hi" in (tmp_path / "logs" / f"{result.process('worker.0').name}.log").read_text()  # the log dir keeps it


def test_a_failed_job_is_a_result_naming_the_failing_worker_with_its_own_last_lines(capfd):
    result = launch([sys.executable, helper("raise_at_step.py")], num_workers=2, num_servers=1,
                    env={"RAISE_RANK": "1", "RAISE_STEP": "3"}, timeout=60)
    assert not result.ok and result.exit_code == 1, result
    cause = result.root_cause
    assert (cause.role, cause.rank, cause.exit_code) == ("worker", 1, 1), cause
    assert cause.pid == result.process("worker.1").pid and cause.process.startswith("worker.1@")
    assert any("RuntimeError: worker 1 fails at step 3" in line for line in cause.last_lines), cause.last_lines
    assert result.process("worker.1").note.startswith("root cause")
    with pytest.raises(JobFailed, match=r"exit code 1: .*worker\.1@.*: RuntimeError: worker 1 fails at step 3$") as failed:
        result.check()
    assert failed.value.result is result and failed.value.exit_code == 1
    assert capfd.readouterr() == ("", "")


def test_what_pslaunch_refuses_before_starting_is_raised_and_unknown_keywords_are_named():
    with pytest.raises(ConfigError, match=r"launch\(num_workers=0\): '0' must be >= 1, got 0"):
        launch(["true"], num_workers=0)
    with pytest.raises(ConfigError, match="--ssh-user is not an option of --launcher local"):
        launch(["true"], num_workers=1, ssh_user="bob")
    with pytest.raises(TypeError, match="launch\\(\\) has no option num_wokers"):
        launch(["true"], num_wokers=1)


@pytest.mark.parametrize("keyword, words", [
    ({"num_server": 1}, "launch() has no option num_server (did you mean num_servers?)"),
    ({"max_restart": 1}, "launch() has no option max_restart (did you mean max_restarts?)"),
    ({"hostfle": "h"}, "launch() has no option hostfle (did you mean hostfile?)"),
])
def test_a_misspelt_keyword_is_named_with_the_nearest_option(keyword, words):
    with pytest.raises(TypeError) as refused:
        launch(["true"], num_workers=1, **keyword)
    assert str(refused.value).startswith(words), refused.value


@pytest.mark.parametrize("keyword, words", [
    ({"timeout": "abc"}, "launch(timeout='abc'): 'abc' is not a valid float."),  # once: '<' between str and int
    ({"num_workers": "two"}, "launch(num_workers='two'): 'two' is not a number of workers: give N or MIN:MAX "
                             "(-n 4, -n 2:4)"),
    ({"restart_scope": "node"}, "launch(restart_scope='node'): 'node' is not one of 'job', 'worker'."),
])
def test_a_value_of_the_wrong_kind_is_refused_naming_the_keyword_and_the_value(keyword, words):
    with pytest.raises(ConfigError) as refused:
        launch(["true"], **{"num_workers": 1, **keyword})
    assert str(refused.value) == words


def test_numbers_given_as_text_are_read_as_the_command_line_reads_them(tmp_path):
    result = launch(["true"], num_workers="2", num_servers="0", timeout="30", dry_run=True)
    assert result.ok and result.plan is not None and result.processes == ()
    assert "worker.1@" in result.plan and "server." not in result.plan


def test_a_dry_run_starts_nothing_and_returns_the_plan_the_command_line_prints(capfd, tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    result = launch([sys.executable, str(script)], num_workers=2, num_servers=1, dry_run=True, quiet=False)
    assert result.ok and result.exit_code == 0 and result.root_cause is None
    out, _ = capfd.readouterr()
    assert result.plan in out and "scheduler.0@" in result.plan and "worker.1@" in result.plan
    with pytest.raises(ConfigError, match="COMMAND's script is missing"):  # what a real run refuses, a dry run too
        launch(["python", str(tmp_path / "missing.py")], num_workers=1, dry_run=True)


def test_a_timeout_is_a_result_without_a_process_to_blame():
    result = launch("sleep 30", num_workers=1, num_servers=0, timeout=1)
    assert result.exit_code == 124 and result.root_cause.process is None, result
    assert result.root_cause.reason == "the job ran longer than --timeout 1 s", result.root_cause
