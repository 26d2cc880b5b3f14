"""The ssh backend against a real sshd on 127.0.0.1-3 (see testkit.launcher.start_sshd)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from testkit.launcher import (
    ancestors,
    cmdline,
    helper,
    processes_with,
    reaped,
    run_pslaunch,
    start_pslaunch,
    start_sshd,
    wait_for_records,
    wait_gone,
)

MULTI = "two\nlines with 'quotes' \"dq\" $HOME `cmd` \\ end\n"
TRICKY = ["--lr", "0.1 x", "it's", 'say "hi"', "$HOME", "back\\slash", "*", "", "new\nline", "ü"]


def _records(out):
    return {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}


def test_ssh_job_places_roles_on_loopback_hosts_with_contract_and_exact_arguments(sshd, tmp_path):
    hosts = sshd.hostfile(tmp_path / "hosts", ["127.0.0.2 slots=1", f"{sshd.user}@127.0.0.3 slots=1"])
    out = tmp_path / "out"
    res = run_pslaunch(["-n", "2", "-s", "2", "-H", hosts, *sshd.ssh_flags(), "--command-for-all-roles",
                        "--shutdown-grace", "0.5", "--env-server", "SLEEP_scheduler:forever",
                        "--env-server", "SLEEP_server=forever", "--env", "CHECK_VARS:CHECK_VARS,MULTI",
                        "--env", "MULTI", sys.executable, helper("role.py"), str(out), *TRICKY],
                       env=dict(os.environ, MULTI=MULTI))
    assert res.returncode == 0, res.stderr
    rec = _records(out)
    assert {r["checked"]["MULTI"] for r in rec.values()} == {MULTI}
    assert sorted(rec) == ["scheduler.0", "server.0", "server.1", "worker.0", "worker.1"]
    for r in rec.values():
        assert r["argv"] == TRICKY
        assert r["env"]["DMLC_PS_ROOT_URI"] == "127.0.0.1"
        assert r["env"]["DMLC_NUM_WORKER"] == "2" and r["env"]["DMLC_NUM_SERVER"] == "2"
    assert rec["worker.0"]["env"]["DMLC_NODE_HOST"] == "127.0.0.2"
    assert rec["worker.1"]["env"]["DMLC_NODE_HOST"] == "127.0.0.3"
    assert "[worker.1@127.0.0.3] worker 1 started" in res.stdout


def _job(sshd, hosts, out, *extra, n=2, s=2):
    return ["-n", str(n), "-s", str(s), "-H", hosts, *sshd.ssh_flags(), "--command-for-all-roles",
            "--shutdown-grace", "0.3", "--stop-grace", "2", "--env-server", "SLEEP_scheduler:forever",
            "--env-server", "SLEEP_server:forever", *extra, sys.executable, helper("role.py"), str(out)]


def test_preflight_names_each_unreachable_host_in_one_line_fast(sshd, tmp_path):
    hosts = sshd.hostfile(tmp_path / "hosts", ["127.0.0.2", "127.0.0.9:1", f"127.0.0.3:{sshd.port}"])
    # fast: a refused port is named at once, not after a wait (the run's deadline is 10 connect timeouts)
    res = run_pslaunch(["-n", "3", "-H", hosts, *sshd.ssh_flags(), "--connect-timeout", "2", "true"], timeout=20)
    assert res.returncode == 3
    assert "1 of 3 host(s) failed the ssh pre-flight check" in res.stderr
    assert f"{sshd.user}@127.0.0.9:1: connection refused on port 1 (is sshd running there? is the port right?)" in res.stderr


def test_preflight_reports_a_wrong_key_as_authentication_failure(sshd, tmp_path):
    import subprocess as sp

    wrong = tmp_path / "wrong_key"
    sp.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(wrong)], check=True, timeout=30)
    hosts = sshd.hostfile(tmp_path / "hosts", ["127.0.0.2"])
    flags = sshd.ssh_flags()
    flags[flags.index("-i") + 1] = str(wrong)
    env = {k: v for k, v in os.environ.items() if k != "SSH_AUTH_SOCK"}
    res = run_pslaunch(["-n", "1", "-H", hosts, *flags, "true"], env=env)
    assert res.returncode == 3
    assert f"{sshd.user}@127.0.0.2:{sshd.port}: authentication failed for user {sshd.user!r} (tried {wrong})" in res.stderr


def test_strict_host_key_policy_refuses_an_unknown_host(sshd, tmp_path):
    hosts = sshd.hostfile(tmp_path / "hosts", ["127.0.0.2"])
    flags = sshd.ssh_flags()
    flags[flags.index("--known-hosts") + 1] = str(tmp_path / "empty_known_hosts")
    res = run_pslaunch(["-n", "1", "-H", hosts, *flags, "--host-key-policy", "strict", "true"])
    assert res.returncode == 3
    assert "unknown host key and --host-key-policy strict" in res.stderr


def test_remote_failure_stops_the_job_with_its_exit_code_and_root_cause(sshd, tmp_path, marker):
    hosts = sshd.hostfile(tmp_path / "hosts", ["127.0.0.2", "127.0.0.3"])
    res = run_pslaunch(_job(sshd, hosts, tmp_path / "out", "--env-worker", "SLEEP_worker:30",
                            "--env-worker", "SLEEP_worker_1:0.2", "--env-worker", "EXIT_worker_1:9") + [marker])
    assert res.returncode == 9, res.stderr
    assert "root cause: worker.1@127.0.0.3 (worker rank 1 on 127.0.0.3, pid " in res.stderr
    assert "failed first: exit code 9" in res.stderr
    assert "| worker 1 started" in res.stderr
    assert wait_gone(marker, 10) == []


def _remote_only(marker):
    """Processes with the marker whose parent chain holds sshd: the remote side of the job."""
    return [line for line in processes_with(marker) if "pslaunch-guard" in line or "role.py" in line]


def test_sigkill_of_pslaunch_kills_remote_processes_and_secrets_stay_out_of_ps(sshd, tmp_path, marker):
    hosts = sshd.hostfile(tmp_path / "hosts", ["127.0.0.2", "127.0.0.3"])
    out = tmp_path / "out"
    secret = "remote-secret-" + marker
    env = dict(os.environ, DB_PASSWORD=secret, CHECK_VARS="DB_PASSWORD")
    with reaped(start_pslaunch(_job(sshd, hosts, out, "--env", "DB_PASSWORD", "--env", "CHECK_VARS",
                                    "--env-worker", "SLEEP_worker:forever") + [marker], env=env), marker) as proc:
        wait_for_records(out, 5, proc)
        listing = subprocess.run(["ps", "-eww", "-o", "args"], capture_output=True, text=True, timeout=10).stdout
        assert "pslaunch-guard" in listing and marker in listing
        assert secret not in listing
        assert _records(out)["worker.1"]["checked"]["DB_PASSWORD"] == secret
        assert len(_remote_only(marker)) >= 4
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=10)
        assert wait_gone(marker, 15) == []


def test_sigint_stops_remote_processes_and_exits_130(sshd, tmp_path, marker):
    hosts = sshd.hostfile(tmp_path / "hosts", ["127.0.0.2"])
    out = tmp_path / "out"
    with reaped(start_pslaunch(_job(sshd, hosts, out, "--env-worker", "SLEEP_worker:forever", n=1, s=1)
                               + [marker]), marker) as proc:
        wait_for_records(out, 3, proc)
        os.kill(proc.pid, signal.SIGINT)
        proc.communicate(timeout=20)
        assert proc.returncode == 130
        assert wait_gone(marker, 10) == []


def test_rsync_copies_the_directory_to_each_host_and_processes_start_there(sshd, tmp_path):
    src = tmp_path / "project"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "data.txt").write_text("payload\n")
    (src / "run.py").write_text("import os, sys, time\nopen(os.path.join(sys.argv[1], os.environ['DMLC_ROLE'] + '.' + "
                                "os.environ['PSLAUNCH_RANK'] + '.cwd'), 'w').write(os.getcwd())\n"
                                "time.sleep(60 if os.environ['DMLC_ROLE'] != 'worker' else 0)\n")
    for junk in (".git", "__pycache__", ".venv"):
        (src / junk).mkdir()
        (src / junk / "junk").write_text("x")
    dst = tmp_path / "remote dir with 'quotes'"
    results = tmp_path / "results"
    results.mkdir()
    hosts = sshd.hostfile(tmp_path / "hosts", ["127.0.0.2", "127.0.0.3"])
    res = run_pslaunch(["-n", "2", "-s", "1", "-H", hosts, *sshd.ssh_flags(), "--sync-dst-dir", str(dst),
                        "--shutdown-grace", "0.3", "--command-for-all-roles", "run.py", str(results)], cwd=str(src))
    assert res.returncode == 0, res.stderr
    assert (dst / "pkg" / "data.txt").read_text() == "payload\n"
    for junk in (".git", "__pycache__", ".venv"):
        assert not (dst / junk).exists()
    assert (results / "worker.0.cwd").read_text() == str(dst)
    assert (results / "worker.1.cwd").read_text() == str(dst)
    assert (results / "server.0.cwd").read_text() == str(dst)
    assert (results / "scheduler.0.cwd").read_text() == str(src)  # on the launching host, in its cwd
    assert "rsync:" in res.stderr


def test_rsync_failure_stops_the_launch_naming_host_and_message(sshd, tmp_path, marker):
    hosts = sshd.hostfile(tmp_path / "hosts", ["127.0.0.2"])
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    res = run_pslaunch(["-n", "1", "-H", hosts, *sshd.ssh_flags(), "--sync-dst-dir", str(blocker / "sub"),
                        sys.executable, helper("sleeper.py"), "30", marker], cwd=str(tmp_path))
    assert res.returncode == 4
    assert f"rsync to 127.0.0.2: cannot create {str(blocker / 'sub')!r} there (mkdir exit 1)" in res.stderr
    assert "Not a directory" in res.stderr
    assert processes_with(marker) == []


def test_rsync_error_stops_the_launch_with_host_exit_code_and_rsync_message(sshd, tmp_path, marker):
    src = tmp_path / "src"
    src.mkdir()
    (src / "thing").write_text("a file here")
    dst = tmp_path / "dst"
    (dst / "thing" / "inner").mkdir(parents=True)  # a non-empty directory where the file must go
    (dst / "thing" / "inner" / "keep").write_text("x")
    hosts = sshd.hostfile(tmp_path / "hosts", ["127.0.0.3"])
    res = run_pslaunch(["-n", "1", "-H", hosts, *sshd.ssh_flags(), "--sync-dst-dir", str(dst),
                        sys.executable, helper("sleeper.py"), "30", marker], cwd=str(src))
    assert res.returncode == 4, res.stderr
    assert f"rsync to 127.0.0.3:{dst} failed with exit code 23: " in res.stderr
    assert "thing" in res.stderr
    assert processes_with(marker) == []


def test_ssh_config_alias_gives_hostname_port_user_and_key_also_to_rsync(sshd, tmp_path):
    config = tmp_path / "ssh_config"
    config.write_text(f"Host trainbox\n  HostName 127.0.0.2\n  Port {sshd.port}\n  User {sshd.user}\n"
                      f"  IdentityFile {sshd.key}\n")
    src = tmp_path / "src"
    src.mkdir()
    (src / "code.txt").write_text("v1\n")
    dst = tmp_path / "dst"
    hosts = sshd.hostfile(tmp_path / "hosts", ["trainbox"])
    out = tmp_path / "out"
    res = run_pslaunch(["-n", "1", "-s", "1", "-H", hosts, "--ssh-config", str(config), "--known-hosts", sshd.known_hosts,
                        "--sync-dst-dir", str(dst), "--command-for-all-roles", "--shutdown-grace", "0.3",
                        "--env-server", "SLEEP_server:forever", "--env-server", "SLEEP_scheduler:forever",
                        sys.executable, helper("role.py"), str(out)], cwd=str(src))
    assert res.returncode == 0, res.stderr
    assert (dst / "code.txt").read_text() == "v1\n"
    assert _records(out)["worker.0"]["cwd"] == str(dst)
    assert "[worker.0@trainbox] worker 0 started" in res.stdout


def test_sigkill_of_pslaunch_also_ends_remote_processes_that_ignore_sigterm(sshd, tmp_path, marker):
    hosts = sshd.hostfile(tmp_path / "hosts", ["127.0.0.3"])
    out = tmp_path / "out"
    with reaped(start_pslaunch(_job(sshd, hosts, out, "--stop-grace", "1", "--env-worker", "SLEEP_worker:forever",
                                    "--env-worker", "IGNORE_TERM_worker:1", n=1, s=1) + [marker]), marker) as proc:
        wait_for_records(out, 3, proc)
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=10)
        assert wait_gone(marker, 10) == []


def test_changed_host_key_is_refused_with_a_clear_line(sshd, tmp_path):
    import subprocess as sp

    other = tmp_path / "other_host_key"
    sp.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True, timeout=30)
    known = tmp_path / "known_hosts"
    kind, blob = (other.with_suffix(".pub")).read_text().split()[:2]
    known.write_text(f"[127.0.0.2]:{sshd.port} {kind} {blob}\n")
    hosts = sshd.hostfile(tmp_path / "hosts", ["127.0.0.2"])
    flags = sshd.ssh_flags()
    flags[flags.index("--known-hosts") + 1] = str(known)
    res = run_pslaunch(["-n", "1", "-H", hosts, *flags, "true"])
    assert res.returncode == 3
    assert f"{sshd.user}@127.0.0.2:{sshd.port}: host key CHANGED: the host offers ssh-ed25519 SHA256:" in res.stderr
    assert (f"but {known} line 1 holds another key for [127.0.0.2]:{sshd.port}. If the host was reinstalled, remove "
            f"that line (ssh-keygen -R '[127.0.0.2]:{sshd.port}' -f {known}) and run again") in res.stderr


def test_a_host_whose_ssh_connection_drops_mid_job_is_the_root_cause_and_pslaunch_exits_255(sshd, tmp_path, marker):
    hosts = sshd.hostfile(tmp_path / "hosts", ["127.0.0.2", "127.0.0.3"])
    out = tmp_path / "out"
    with reaped(start_pslaunch(_job(sshd, hosts, out, "--env-worker", "SLEEP_worker:forever", s=1) + [marker]),
                marker) as proc:
        wait_for_records(out, 4, proc)
        worker = _records(out)["worker.1"]["pid"]  # the only process on 127.0.0.3
        # the host "dies": the sshd processes that serve its connection go away at once
        sessions = [pid for pid in ancestors(worker)
                    if cmdline(pid).startswith("sshd:") and "[listener]" not in cmdline(pid)]
        assert sessions, [cmdline(pid) for pid in ancestors(worker)]
        for pid in sessions:
            os.kill(pid, signal.SIGKILL)
        _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 255, stderr.decode()
    assert ("root cause: host 127.0.0.3 lost (its ssh connection dropped): pslaunch could not reach worker.1@127.0.0.3\n"
            in stderr.decode()), stderr.decode()
    assert "| host lost (its ssh connection dropped) |" in stderr.decode()
    assert wait_gone(marker, 15) == []


def test_python_as_first_word_runs_the_launching_interpreter_on_remote_hosts(sshd, tmp_path):
    hosts = sshd.hostfile(tmp_path / "hosts", ["127.0.0.2"])
    out = tmp_path / "out"
    # `python` alone would be whatever the remote login shell finds first on its PATH
    res = run_pslaunch(["-n", "1", "-s", "1", "-H", hosts, *sshd.ssh_flags(), "--command-for-all-roles",
                        "--shutdown-grace", "0.3", "--env-server", "SLEEP_server:forever", "--env-server",
                        "SLEEP_scheduler:forever", "python", helper("role.py"), str(out)])
    assert res.returncode == 0, res.stderr
    assert {r["executable"] for r in _records(out).values()} == {sys.executable}


def test_a_missing_script_on_a_remote_host_is_exit_2_before_anything_starts(sshd, tmp_path):
    hosts = sshd.hostfile(tmp_path / "hosts", ["127.0.0.2"])
    res = run_pslaunch(["-n", "1", "-H", hosts, *sshd.ssh_flags(), "python", "no_such_train.py", "--lr", "1"],
                       cwd=str(tmp_path))
    assert res.returncode == 2, res.stderr
    assert res.stderr == (f"pslaunch: error: COMMAND's script is missing: 'no_such_train.py' is not a file in {tmp_path} "
                          "on 127.0.0.2 (the script of worker.0@127.0.0.2); nothing was started\n")


def test_proxyjump_from_ssh_config_reaches_hosts_through_a_bastion(sshd, tmp_path):
    bastion_dir = tmp_path / "bastion"
    bastion_dir.mkdir()
    bastions = start_sshd(bastion_dir, hosts=("127.0.0.1",), log_level="DEBUG1",
                          authorized_key=open(sshd.key + ".pub").read())
    bastion = next(bastions)
    try:
        config = tmp_path / "ssh_config"
        config.write_text(f"Host node-a\n  HostName 127.0.0.3\n  Port {sshd.port}\n  ProxyJump gate\n"
                          f"Host gate\n  HostName 127.0.0.1\n  Port {bastion.port}\n"
                          f"Host node-b\n  HostName 127.0.0.2\n  Port {sshd.port}\n  ProxyJump 127.0.0.1:1\n")
        out = tmp_path / "out"
        common = ["-i", sshd.key, "--known-hosts", sshd.known_hosts, "--ssh-config", str(config)]
        res = run_pslaunch(["-n", "1", "-s", "1", "-H", sshd.hostfile(tmp_path / "hosts", ["node-a"]), *common,
                            "--command-for-all-roles", "--shutdown-grace", "0.3", "--env-server", "SLEEP_server:forever",
                            "--env-server", "SLEEP_scheduler:forever",
                            # the worker ends only once the server (started through the bastion: the
                            # slowest) wrote its record, which the shutdown grace would otherwise race
                            "--env-worker", f"SLEEP_worker:until:{out / 'server.0.json'}",
                            sys.executable, helper("role.py"), str(out)])
        assert res.returncode == 0, res.stderr
        assert "[worker.0@node-a] worker 0 started" in res.stdout
        assert sorted(_records(out)) == ["scheduler.0", "server.0", "worker.0"]
        # the bastion's sshd opened the connection to the host for us
        assert f"target 127.0.0.3 port {sshd.port}" in (bastion_dir / "sshd.log").read_text()
        bad = run_pslaunch(["-n", "1", "-H", sshd.hostfile(tmp_path / "hosts2", ["node-b"]), *common, "true"])
        assert bad.returncode == 3, bad.stderr
        assert (f"{sshd.user}@node-b:{sshd.port}: bastion {sshd.user}@127.0.0.1:1 (ProxyJump): connection refused on port 1"
                in bad.stderr), bad.stderr
    finally:
        bastions.close()
