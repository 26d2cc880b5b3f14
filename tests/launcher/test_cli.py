"""The CLI: flags, --dry-run, one-line errors with exit codes, and what importing it loads."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from testkit.launcher import REPO, run_pslaunch


def test_dry_run_prints_the_plan_with_hosts_argv_and_env_names_but_no_secret_values(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.2 slots=1\n127.0.0.3 slots=1\n")
    res = run_pslaunch(["-n", "2", "-s", "1", "-H", str(hosts), "--dry-run", "--env", "API_KEY:topsecret-42",
                        "--env-worker", "W=worker-secret", "train.py", "--lr", "0.1 x"])
    assert res.returncode == 0, res.stderr
    assert "backend ssh" in res.stdout
    assert "worker.0@127.0.0.2" in res.stdout and "worker.1@127.0.0.3" in res.stdout
    assert "train.py --lr '0.1 x'" in res.stdout
    assert "API_KEY" in res.stdout and "W" in res.stdout
    assert "topsecret-42" not in res.stdout + res.stderr
    assert "worker-secret" not in res.stdout + res.stderr


def test_unknown_backend_error_lists_the_names_launcher_takes_and_exits_2():
    res = run_pslaunch(["-n", "1", "--launcher", "yarn", "true"])
    assert res.returncode == 2
    # the per-node agents are no --launcher name (that one is refused): --nnodes selects them
    assert res.stderr.strip() == ("pslaunch: error: unknown launcher backend 'yarn'; --launcher takes local, mpi, ray, "
                                  "sge, slurm, ssh (--nnodes N runs pslaunch as per-node agents)")


def test_hostfile_error_is_one_line_naming_file_and_line_and_exits_2(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("good\nbad:port\n")
    res = run_pslaunch(["-n", "1", "-H", str(hosts), "true"])
    assert res.returncode == 2
    assert res.stderr == f"pslaunch: error: {hosts}:2: 'bad:port': ssh port 'port' is not a number in 1..65535\n"


def test_missing_num_workers_is_a_usage_error():
    res = run_pslaunch(["true"])
    assert res.returncode == 2
    assert "Missing option '-n' / '--num-workers'" in res.stderr


def test_importing_the_cli_loads_neither_runtime_nor_zmq_numpy_nor_paramiko():
    code = ("import sys, launcher.cli, launcher.planning.plan, launcher.supervision.supervisor, launcher.backends.local;"
            "bad = [m for m in ('psnode', 'kvcore', 'zmq', 'numpy', 'paramiko') if m in sys.modules];"
            "print(bad); sys.exit(1 if bad else 0)")
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stdout + res.stderr


def test_scheduler_host_with_the_local_backend_is_refused():
    res = run_pslaunch(["-n", "1", "--launcher", "local", "--scheduler-host", "h", "true"])
    assert res.returncode == 2
    assert "--scheduler-host is not an option of --launcher local: the local backend runs every process on this machine" in res.stderr


def test_negative_grace_is_refused_naming_the_flag():
    res = run_pslaunch(["-n", "1", "--stop-grace", "-1", "--dry-run", "true"])
    assert res.returncode == 2
    assert res.stderr == "pslaunch: error: --stop-grace must be >= 0 seconds, got -1.0\n"


def test_version_prints_the_packages_version():
    from importlib.metadata import version

    res = run_pslaunch(["--version"])
    assert (res.returncode, res.stdout) == (0, f"pslaunch {version('pslaunch')}\n")


@pytest.mark.parametrize("args,count", [(["-np", "4", "train.py"], "4"), (["-H", "hosts", "-np=8", "train.py"], "8")])
def test_mpiruns_np_is_answered_with_did_you_mean_n(args, count):
    res = run_pslaunch(args)
    assert res.returncode == 2
    assert res.stderr == (f"pslaunch: error: -np is mpirun's; pslaunch counts workers with -n: did you mean -n {count}? "
                          "(pslaunch --help lists every option)\n")


@pytest.mark.parametrize("args, words", [
    (["--nproc-per-node", "2", "train.py"], "--nproc-per-node is torchrun's; it counts processes per node, and "
     "pslaunch's -n counts every worker of the job (spread over the hosts): did you mean -n 2? (a plain torch script "
     "needs no servers: -n 2 -s 0)"),
    (["--nproc_per_node=4", "train.py"], "--nproc_per_node is torchrun's; it counts processes per node, and pslaunch's "
     "-n counts every worker of the job (spread over the hosts): did you mean -n 4?"),
    (["--standalone", "--nproc-per-node", "2", "train.py"], "--standalone is torchrun's; pslaunch needs no rendezvous "
     "on one machine: drop --standalone (pslaunch -n N -s 0 train.py runs N workers here)"),
    (["-n", "2", "--tee", "3", "train.py"], "--tee is torchrun's; pslaunch shows every process's output"),
    (["-n", "2", "--redirects", "3", "train.py"], "--redirects is torchrun's; pslaunch keeps each process's output "
     "apart already: --log-dir DIR writes a file per process"),
    (["-n", "2", "--no-python", "train"], "--no-python is torchrun's; pslaunch runs COMMAND as given"),
    (["-n", "2", "--run-path", "train.py"], "--run-path is torchrun's; pslaunch runs a script by its path"),
    (["-n", "2", "--rdzv-backend", "c10d", "train.py"], "--rdzv-backend is torchrun's; pslaunch's per-node agents meet "
     "at node 0 themselves, with no rendezvous backend"),
    (["-n", "2", "--rdzv_endpoint", "h:29400", "train.py"], "--rdzv_endpoint is spelt --rdzv-endpoint in pslaunch"),
])
def test_torchruns_flags_get_the_pslaunch_way_or_why_none_is_needed(args, words):
    # click once answered --nproc-per-node with "Did you mean '--gpus-per-worker'?", and the others with
    # "No such option"
    res = run_pslaunch(args)
    assert res.returncode == 2
    assert res.stderr.startswith(f"pslaunch: error: {words}") and len(res.stderr.splitlines()) == 1, res.stderr
    assert "gpus-per-worker" not in res.stderr


def test_np_after_the_command_is_the_commands_own(tmp_path):
    (tmp_path / "app.py").write_text("")  # --dry-run checks that the script is there
    res = run_pslaunch(["-n", "1", "-s", "0", "--dry-run", "python", "app.py", "-np", "3"], cwd=str(tmp_path))
    assert res.returncode == 0, res.stderr
    assert "app.py -np 3" in res.stdout


def test_x_sets_a_variable_for_every_process_as_mpiruns_does():
    code = "import os; print('FOO is', os.environ['FOO'])"
    res = run_pslaunch(["-n", "2", "-s", "0", "-x", "FOO=bar=baz", "python", "-c", code])
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("FOO is bar=baz") == 2, res.stdout


@pytest.mark.parametrize("args,message", [
    (["-n", "1", "-s", "x", "true"], "Invalid value for '-s' / '--num-servers': 'x' is not a valid integer."),
    (["-n", "x", "true"], "-n/--num-workers 'x' is not a number of workers: give N or MIN:MAX (-n 4, -n 2:4)"),
    (["-n", "0", "true"], "-n/--num-workers '0' must be >= 1, got 0"),
    (["-n", "1", "--bogus", "true"], "No such option '--bogus'."),
    (["-n", "1"], "Missing argument 'COMMAND...'."),
])
def test_clicks_own_errors_are_one_line_in_pslaunchs_format(args, message):
    res = run_pslaunch(args)
    assert res.returncode == 2
    assert res.stderr.startswith(f"pslaunch: error: {message}") and res.stderr.count("\n") == 1, res.stderr


def test_a_hostfile_host_that_does_not_resolve_is_named_with_its_line(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.2 slots=1\n# the next one is mistyped\nnosuchhost.invalid slots=2\n")
    res = run_pslaunch(["-n", "2", "-H", str(hosts), "--dry-run", "train.py"])
    assert res.returncode == 2
    assert res.stderr.startswith(f"pslaunch: error: {hosts}:3: host nosuchhost.invalid does not resolve on this "
                                 "machine: unknown name"), res.stderr


def test_help_lists_every_option_under_one_section():
    from launcher.cli import HELP_SECTIONS, cli

    options = {p.name for p in cli.params if p.param_type_name == "option"} - {"version"}
    placed = [name for names in HELP_SECTIONS.values() for name in names]
    assert sorted(placed) == sorted(options)  # each option once, none left out
    res = run_pslaunch(["--help"])
    assert res.returncode == 0
    titles = [line[:-1] for line in res.stdout.splitlines() if line.endswith(":") and not line.startswith(" ")]
    assert titles == [*HELP_SECTIONS, "Other"], res.stdout
    assert "--sge-pe NAME" in res.stdout.split("Batch systems:")[1].split("Output:")[0]


def test_dry_run_refuses_what_a_real_run_refuses_a_missing_script_and_mpis_worker_restarts(tmp_path):
    for args in (["python", "no_such_script.py"], ["--launcher", "mpi", "--restart-scope", "worker", "--max-restarts", "1",
                                                    "--allow-restart-from-scratch", "true"]):
        dry = run_pslaunch(["-n", "1", "--dry-run", *args], cwd=str(tmp_path), timeout=30)
        real = run_pslaunch(["-n", "1", *args], cwd=str(tmp_path), timeout=30)
        assert dry.returncode == real.returncode == 2, (dry, real)
        assert dry.stderr == real.stderr, (dry.stderr, real.stderr)  # the same refusal, word for word
        assert "script is missing" in dry.stderr or "--restart-scope worker cannot be used" in dry.stderr, dry.stderr


def test_more_servers_than_workers_is_warned_about_once_and_still_runs(tmp_path):
    res = run_pslaunch(["-n", "2", "-s", "5", "--dry-run", "true"])
    assert res.returncode == 0, res.stderr
    assert res.stderr.count("pslaunch: warning: -s 5 starts more servers than there are workers (-n 2)") == 1
    assert "warning" not in run_pslaunch(["-n", "2", "-s", "2", "--dry-run", "true"]).stderr
    assert "warning" not in run_pslaunch(["-n", "2", "-s", "5", "-q", "--dry-run", "true"]).stderr


@pytest.mark.parametrize("forwarded", [False, True], ids=["environment-only", "with---env"])
def test_a_setting_in_pslaunchs_own_environment_reaches_the_job_only_with_env_and_pslaunch_says_so(tmp_path, forwarded):
    script = tmp_path / "show.py"
    script.write_text("import os\nprint('SEEN', os.environ.get('PSLAUNCH_SAME_HOST'), flush=True)\n")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PSLAUNCH_")}, "PSLAUNCH_SAME_HOST": "tcp"}
    args = ["-n", "1", "-s", "0", "--no-dashboard", *(["--env", "PSLAUNCH_SAME_HOST"] if forwarded else []),
            "python", str(script)]
    res = run_pslaunch(args, env=env, timeout=60)
    assert res.returncode == 0, res.stderr
    note = ("pslaunch: PSLAUNCH_SAME_HOST is set in pslaunch's environment but not passed to the job: a setting "
            "must be the same in every process, so give it with --env PSLAUNCH_SAME_HOST (docs/env.md)")
    if forwarded:
        assert "SEEN tcp" in res.stdout and note not in res.stderr, res.stdout + res.stderr
    else:
        assert "SEEN None" in res.stdout and res.stderr.count(note) == 1, res.stdout + res.stderr
