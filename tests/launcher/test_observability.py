"""Seeing a real job: the dashboard in a real terminal (tmux), and not outside one; the metrics
endpoint while the job runs, the timeline and the summary JSON of a job over ssh."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
import urllib.request
import uuid
from collections import defaultdict

import pytest

from launcher.config import free_port
from testkit.launcher import REPO, helper, processes_with, reaped, run_pslaunch, start_pslaunch, wait_gone

TRAIN = helper("train_loop.py")


def _tmux(socket_name: str, *args: str) -> str:
    return subprocess.run(["tmux", "-L", socket_name, *args], capture_output=True, text=True, check=True,
                          timeout=10).stdout


@pytest.mark.parametrize(("columns", "lines"), [(80, 24), (200, 50)])
def test_the_dashboard_in_a_terminal_shows_every_process_with_live_rates_and_marks_the_slowed_worker(
        columns, lines, tmp_path, marker):
    if shutil.which("tmux") is None:
        pytest.fail("tmux is missing: run scripts/test.sh (it installs tmux)")
    socket_name = f"pslaunch-{marker}"
    script = tmp_path / "job.sh"
    # worker 1 computes 0.25 s a round, the others 0.01 s: in dist_sync they wait for it
    script.write_text(
        f"cd {REPO}\nexport PYTHONPATH={REPO} SECONDS_TO_RUN=15 SLOW_RANK=1 SLOW_SLEEP=0.25\n"
        f"{sys.executable} -m launcher.cli -n 3 -s 1 {sys.executable} {TRAIN} {marker}\necho EXIT=$?\n")
    _tmux(socket_name, "new-session", "-d", "-s", "job", "-x", str(columns), "-y", str(lines), "bash --norc --noprofile")
    screen = ""
    try:
        _tmux(socket_name, "send-keys", "-t", "job", f"bash {script}", "Enter")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            screen = _tmux(socket_name, "capture-pane", "-p", "-t", "job")
            rows = _dashboard_rows(screen)
            workers = [rows.get(f"worker.{r}@localhost", "") for r in range(3)]
            if all(_rates(line) for line in workers) and "<< straggler" in workers[1]:
                break
            assert "EXIT=" not in screen, screen
            time.sleep(0.5)
        else:
            raise AssertionError(f"the dashboard never showed every worker's rates and the straggler:\n{screen}")
        assert set(rows) == {"scheduler.0@localhost", "server.0@localhost", "worker.0@localhost",
                             "worker.1@localhost", "worker.2@localhost"}, screen
        assert "straggler: worker.1@localhost" in " ".join(screen.split()), screen  # the title may wrap
        assert all("<< straggler" not in workers[r] for r in (0, 2)), screen
        # every line fits the terminal: the table drops columns rather than wrapping
        table = screen[screen.index("pslaunch job"):]
        assert all(len(line) <= columns for line in table.splitlines()), screen
        if columns >= 200:  # every column; at 80 the server's keys are among the first to go
            assert " 22 " in rows["server.0@localhost"], screen  # the keys it holds: w, 20 small ones, stop
        else:
            assert "keys" not in table and "note" in table and "rounds/s" in table, screen
        end = time.monotonic() + 90
        while "EXIT=" not in screen and time.monotonic() < end:
            time.sleep(0.5)
            screen = _tmux(socket_name, "capture-pane", "-p", "-S", "-200", "-t", "job")
        assert "EXIT=0" in screen, screen
        assert "[worker.1@localhost] done 1" in screen and "<< straggler" not in screen.split("done 1")[-1], screen
    finally:
        subprocess.run(["tmux", "-L", socket_name, "kill-server"], timeout=10)
        for line in processes_with(marker):
            subprocess.run(["kill", "-9", line.split(":")[0]], timeout=10)
    assert wait_gone(marker, 10) == [], screen


def _dashboard_rows(screen: str) -> dict[str, str]:
    """The dashboard's rows on the screen, by process name (the line that starts with the name)."""
    rows = {}
    for line in screen.splitlines():
        match = re.match(r"^ ?((?:scheduler|server|worker)\.\d+@\S+) +(starting|registered|running|registering|ending)", line)
        if match:
            rows[match[1]] = line
    return rows


def _rates(line: str) -> bool:
    """Whether a worker's row shows non-zero push MB/s, pull MB/s and rounds/s."""
    numbers = re.findall(r"\s(\d+\.\d+)\s", line + " ")
    return len(numbers) >= 3 and all(float(n) > 0 for n in numbers[:3])


def test_a_dashboard_asked_for_with_output_piped_to_files_prints_no_control_codes(tmp_path, marker):
    res = run_pslaunch(["-n", "2", "-s", "1", "--dashboard", "--env-worker", "SECONDS_TO_RUN:1", "python", TRAIN,
                        marker], timeout=120)
    assert res.returncode == 0, res.stderr
    assert "[worker.0@localhost] done 0" in res.stdout and "pslaunch job" in res.stderr
    assert "\x1b" not in res.stdout and "\x1b" not in res.stderr and "\r" not in res.stdout + res.stderr
    assert wait_gone(marker, 10) == []


@pytest.fixture(scope="module")
def observed_ssh_job(sshd, tmp_path_factory):
    """One job over ssh (workers on 127.0.0.2 and .3, servers round-robin, the scheduler here) with
    --metrics-port, --timeline and --summary-json; the metrics are read while it runs."""
    tmp = tmp_path_factory.mktemp("observed")
    # unique across the suite's processes: each builds this fixture once, in a folder of the same name,
    # and the end of one run kills what carries its marker (another's job, once)
    marker = f"pslaunch-test-observed-{uuid.uuid4().hex[:10]}"
    hosts = sshd.hostfile(tmp / "hosts", ["127.0.0.2", "127.0.0.3"])
    port = free_port()
    timeline, summary = tmp / "trace.json", tmp / "summary.json"
    args = ["-n", "2", "-s", "2", "-H", hosts, *sshd.ssh_flags(), "--metrics-port", str(port), "--timeline",
            str(timeline), "--summary-json", str(summary), "--env-worker", "SECONDS_TO_RUN:6", "python", TRAIN, marker]
    scrapes = []
    with reaped(start_pslaunch(args), marker) as proc:
        deadline = time.monotonic() + 90
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
                    scrapes.append(reply.read().decode())
            except OSError:
                pass  # not listening yet, or the job just ended
            time.sleep(0.5)
        out, err = proc.communicate(timeout=60)
    yield {"code": proc.returncode, "stdout": out.decode(), "stderr": err.decode(), "scrapes": scrapes,
           "timeline": timeline, "summary": summary, "marker": marker}


def _sample(text: str, metric: str, process: str) -> float | None:
    match = re.search(rf'^{metric}{{[^}}]*process="{re.escape(process)}"[^}}]*}} (\S+)$', text, re.M)
    return None if match is None else float(match[1])


@pytest.mark.xdist_group("observed_ssh_job")  # one job for the three, on one of the suite's processes
def test_the_metrics_endpoint_answers_during_the_job_with_every_workers_and_servers_counters(observed_ssh_job):
    job = observed_ssh_job
    assert job["code"] == 0, job["stderr"]
    workers, servers = ("worker.0@127.0.0.2", "worker.1@127.0.0.3"), ("server.0@127.0.0.2", "server.1@127.0.0.3")

    def running_with_counters(text):
        return (all(_sample(text, "pslaunch_up", n) == 1 for n in workers + servers)
                and all((_sample(text, "pslaunch_worker_pushed_bytes_total", n) or 0) > 0 for n in workers)
                and all((_sample(text, "pslaunch_worker_rounds_total", n) or 0) > 0 for n in workers)
                and all((_sample(text, "pslaunch_server_received_bytes_total", n) or 0) > 0 for n in servers)
                and all((_sample(text, "pslaunch_server_keys", n) or 0) > 0 for n in servers))

    live = [text for text in job["scrapes"] if running_with_counters(text)]
    assert live, f"no scrape while every process ran had every counter; {len(job['scrapes'])} scrapes, the last:\n" \
                 f"{job['scrapes'][-1:]}"
    text = live[-1]
    assert "# TYPE pslaunch_worker_wait_seconds_total counter" in text


@pytest.mark.xdist_group("observed_ssh_job")  # one job for the three, on one of the suite's processes
def test_the_timeline_loads_as_json_with_nested_events_of_every_worker_and_server_over_ssh(observed_ssh_job):
    job = observed_ssh_job
    assert job["code"] == 0, job["stderr"]
    events = json.loads(job["timeline"].read_text())
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    by_node = defaultdict(set)
    for event in events:
        if event["ph"] == "X":
            by_node[names[event["pid"]].split(" (")[0]].add(event["name"].split(" ")[0])
    assert {"push", "pull", "wait", "register"} <= by_node["worker 0"] and {"push", "pull", "wait"} <= by_node["worker 1"]
    assert {"merge", "update"} <= by_node["server 0"] and {"merge", "update"} <= by_node["server 1"]
    assert {"registration", "barrier"} <= by_node["scheduler"]
    assert any(e["name"] == "push w" for e in events)  # named by the user's key
    # one track per thread: events either contain one another or do not overlap
    tracks = defaultdict(list)
    for event in events:
        if event["ph"] == "X":
            tracks[(event["pid"], event["tid"])].append((event["ts"], event["ts"] + event["dur"], event["name"]))
    for spans in tracks.values():
        spans.sort(key=lambda s: (s[0], -s[1]))
        open_spans: list[tuple] = []
        for start, end, name in spans:
            while open_spans and open_spans[-1][1] <= start:
                open_spans.pop()
            assert not open_spans or end <= open_spans[-1][1] + 0.001, (name, open_spans[-1])
            open_spans.append((start, end, name))
    pulls = [(e["pid"], e["tid"], e["ts"], e["ts"] + e["dur"]) for e in events if e["name"] == "pull w"]
    waits = [(e["pid"], e["tid"], e["ts"], e["ts"] + e["dur"]) for e in events if e["name"] == "wait"]
    assert any(p[:2] == w[:2] and p[2] <= w[2] and w[3] <= p[3] for p in pulls for w in waits)  # a pull waited


@pytest.mark.xdist_group("observed_ssh_job")  # one job for the three, on one of the suite's processes
def test_the_summary_json_has_each_processs_exit_duration_and_bytes(observed_ssh_job):
    job = observed_ssh_job
    assert job["code"] == 0, job["stderr"]
    summary = json.loads(job["summary"].read_text())
    assert summary["ok"] is True and summary["exit_code"] == 0 and summary["root_cause"] is None
    processes = {p["name"]: p for p in summary["processes"]}
    assert set(processes) == {"scheduler.0@localhost", "server.0@127.0.0.2", "server.1@127.0.0.3",
                              "worker.0@127.0.0.2", "worker.1@127.0.0.3"}
    for name, entry in processes.items():
        assert entry["exit_code"] == 0 and entry["duration_s"] > 0, entry
    for name in ("worker.0@127.0.0.2", "worker.1@127.0.0.3"):
        assert processes[name]["pushed_bytes"] > 0 and processes[name]["pulled_bytes"] > 0
        assert processes[name]["rounds"] == processes["worker.0@127.0.0.2"]["rounds"] > 0
    assert processes["server.0@127.0.0.2"]["received_bytes"] > 0 and processes["server.1@127.0.0.3"]["updates"] > 0
    assert wait_gone(job["marker"], 10) == []


def test_the_summary_json_names_the_root_cause_of_a_failed_job(tmp_path, marker):
    summary = tmp_path / "summary.json"
    res = run_pslaunch(["-n", "2", "-s", "1", "--summary-json", str(summary), "--env", "RAISE_RANK:1", "--env",
                        "RAISE_STEP:2", "python", helper("raise_at_step.py"), marker], timeout=120)
    assert res.returncode == 1, res.stderr
    document = json.loads(summary.read_text())
    assert document["ok"] is False and document["exit_code"] == 1
    assert document["root_cause"]["process"] == "worker.1@localhost"
    assert "failed first: exit code 1" in document["root_cause"]["reason"]
    assert any("RuntimeError: worker 1 fails at step 2" in line for line in document["root_cause"]["last_lines"])
    notes = {p["name"]: p["note"] for p in document["processes"]}
    assert notes["worker.1@localhost"] == "root cause"
    assert wait_gone(marker, 10) == []
