"""What pslaunch makes of the runtime's stats and trace lines: rows, rates, the straggler, the
dashboard's table and terminal region, Prometheus text, the timeline file and the summary JSON.

These are the pure parts, fed the lines a scheduler writes; test_observability.py runs real jobs.
"""

from __future__ import annotations

import io
import json
import urllib.error
import urllib.request

import pytest

from launcher.backends.base import ExitStatus, ProcessHandle
from launcher.errors import ConfigError
from launcher.observe.dashboard import Dashboard, render_table
from launcher.observe.jobstats import STARTING_SECONDS, JobStats
from launcher.observe.metrics import MetricsServer, render_metrics
from launcher.observe.observer import summary_document
from launcher.observe.timeline import TraceFile
from launcher.planning.hostfile import LOCAL_HOST
from launcher.planning.plan import ProcessSpec
from launcher.supervision.verdict import Failure

pytestmark = pytest.mark.unit


class Handle(ProcessHandle):
    """pslaunch's view of a process, set by the test (nothing is started)."""

    def __init__(self, role: str, rank: int, pid: int) -> None:
        super().__init__(ProcessSpec(role, rank, LOCAL_HOST, ("x",), {}))
        self.pid = pid

    def _poll(self):
        return self.status

    terminate = kill = suspend = resume = request_end = lambda self: None


def job_handles():
    return [Handle("scheduler", 0, 100), Handle("server", 0, 101), Handle("worker", 0, 102),
            Handle("worker", 1, 103), Handle("worker", 2, 104)]


def stats_line(t, workers, server=None, age=0.2, hb=1.0, phase="running"):
    """A scheduler's stats line: ``workers`` maps a rank to its counters (wait_s, rounds, push_b ...)."""
    nodes = [{"role": "worker", "rank": r, "host": "127.0.0.1", "pid": 102 + r, "state": "running", "age": age,
              "s": {"t": t, "lr": r, "cpu": t / 2, "rss": 1 << 24, **counters}} for r, counters in workers.items()]
    if server is not None:
        nodes.append({"role": "server", "rank": 0, "host": "127.0.0.1", "pid": 101, "state": "running", "age": age,
                      "s": {"t": t, "lr": 0, **server}})
    return json.dumps({"v": 1, "t": t, "phase": phase, "hb": hb, "hbt": 10.0,
                       "self": {"cpu": t / 10, "rss": 1 << 23, "pid": 100}, "nodes": nodes})


def sync_job(stats, handles, seconds=4):
    """Feed reports of a dist_sync job in which worker 1 computes ten times longer than the others:
    every worker runs 5 rounds a second; workers 0 and 2 wait 90% of the time, worker 1 10%."""
    for t in range(seconds + 1):
        workers = {r: {"rounds": 5 * t, "wait_s": (0.1 if r == 1 else 0.9) * t, "push_b": 2e6 * t, "pull_b": 1e6 * t}
                   for r in range(3)}
        assert stats.take_line(handles[0], stats_line(float(t), workers, {"keys": 4, "held_b": 4096, "push_b": 6e6 * t,
                                                                          "updates": 20 * t, "waiting": 2}), handles)


def test_rows_carry_rates_over_the_reports_and_mark_the_worker_the_others_wait_for():
    stats, handles = JobStats(), job_handles()
    sync_job(stats, handles)
    rows = {r.name: r for r in stats.rows(handles)}
    slow, fast = rows["worker.1@localhost"], rows["worker.0@localhost"]
    assert slow.straggler and not fast.straggler and not rows["worker.2@localhost"].straggler
    assert fast.rates["rounds"] == pytest.approx(5) and fast.rates["push_b"] == pytest.approx(2e6)
    assert fast.wait_share == pytest.approx(0.9) and slow.wait_share == pytest.approx(0.1)
    assert fast.cpu_percent == pytest.approx(50) and fast.rss == 1 << 24
    server = rows["server.0@localhost"]
    assert server.rates["updates"] == pytest.approx(20) and server.counters["waiting"] == 2
    assert rows["scheduler.0@localhost"].state == "running" and rows["scheduler.0@localhost"].cpu_percent == pytest.approx(10)
    assert all(r.state == "running" and not r.late for r in rows.values())


def test_in_dist_async_the_straggler_is_the_worker_with_the_fewest_rounds_and_none_stands_out_when_even():
    stats, handles = JobStats(), job_handles()
    for t in range(4):  # everyone waits 20%; worker 2 does 2 rounds a second, the others 8
        stats.take_line(handles[0], stats_line(float(t), {r: {"rounds": (2 if r == 2 else 8) * t, "wait_s": 0.2 * t}
                                                          for r in range(3)}), handles)
    assert [r.name for r in stats.rows(handles) if r.straggler] == ["worker.2@localhost"]
    even = JobStats()
    for t in range(4):
        even.take_line(handles[0], stats_line(float(t), {r: {"rounds": 8 * t, "wait_s": (0.2 + 0.02 * r) * t}
                                                         for r in range(3)}), handles)
    assert not any(r.straggler for r in even.rows(handles))


def test_a_heartbeat_older_than_two_and_a_half_intervals_is_late_and_an_exited_process_shows_its_exit():
    stats, handles = JobStats(), job_handles()
    assert {r.state for r in stats.rows(handles)} == {"starting"}  # no stats line yet
    stats.take_line(handles[0], stats_line(1.0, {0: {}, 1: {}, 2: {}}, age=3.0), handles)
    handles[4].status = ExitStatus(code=3)
    rows = {r.name: r for r in stats.rows(handles)}
    assert rows["worker.0@localhost"].late and rows["worker.0@localhost"].heartbeat_age >= 3.0
    gone = rows["worker.2@localhost"]
    assert gone.exited and gone.state == "exit 3" and not gone.late and gone.exit_code == 3
    # every node registered (the job runs), yet this one sent no record: it runs, not as the runtime
    assert rows["server.0@localhost"].state == "running" and rows["server.0@localhost"].heartbeat_age is None


def test_a_process_that_never_joins_the_runtime_runs_once_its_first_seconds_are_over():
    stats, handles = JobStats(), job_handles()
    stats.take_line(handles[0], stats_line(1.0, {0: {}}, phase="registering"), handles)  # workers 1, 2 not (yet)
    handles[3].started -= STARTING_SECONDS + 1  # worker 1 started a while ago: a torch script, say
    rows = {r.name: r for r in stats.rows(handles)}
    assert rows["worker.1@localhost"].state == "running"
    assert rows["worker.2@localhost"].state == "starting"  # just started


def test_after_a_restart_rates_start_afresh_and_a_worker_awaiting_its_restart_is_rejoining_not_late():
    stats, handles = JobStats(), job_handles()
    sync_job(stats, handles)
    restarted = [Handle(h.spec.role, h.spec.rank, h.pid + 10) for h in handles]  # the job started again
    for t in (5.0, 6.0):  # the hosts' clocks go on, the new processes' counters start from zero
        workers = {r: {"rounds": 2 * (t - 5), "wait_s": 0.5 * (t - 5), "push_b": 1e6 * (t - 5)} for r in range(3)}
        assert stats.take_line(restarted[0], stats_line(t, workers), restarted)
    rows = {r.name: r for r in stats.rows(restarted)}
    assert rows["worker.0@localhost"].rates["rounds"] == pytest.approx(2)
    assert rows["worker.0@localhost"].rates["push_b"] == pytest.approx(1e6)
    line = json.loads(stats_line(7.0, {0: {}, 1: {}, 2: {}}, age=30.0))
    line["nodes"][1]["state"] = "rejoining"  # worker 1 died; pslaunch restarts it alone
    assert stats.take_line(restarted[0], json.dumps(line), restarted)
    rows = {r.name: r for r in stats.rows(restarted)}
    assert rows["worker.1@localhost"].state == "rejoining" and not rows["worker.1@localhost"].late
    assert rows["worker.0@localhost"].late  # 30 s without a heartbeat, running


def test_malformed_stats_lines_are_counted_and_dropped_keeping_the_last_good_one():
    stats, handles = JobStats(), job_handles()
    assert stats.take_line(handles[0], stats_line(1.0, {0: {"rounds": 3}}), handles)
    good = json.loads(stats_line(2.0, {0: {"rounds": 4}}))
    bad = ["not json", "[]", json.dumps({**good, "v": 2}), json.dumps({**good, "phase": "dancing"}),
           json.dumps({**good, "nodes": [{"role": "boss", "rank": 0}]}),
           json.dumps({**good, "nodes": [{**good["nodes"][0], "s": {"rounds": "many"}}]}),
           json.dumps({**good, "self": {"cpu": -1, "rss": 1, "pid": 1}}), "x" * (2 << 20)]
    for line in bad:
        assert not stats.take_line(handles[0], line, handles)
    assert stats.rejected == len(bad)
    assert stats.rows(handles)[2].counters["rounds"] == 3


def test_the_table_names_every_process_and_marks_the_straggler_in_words_and_fits_the_lines_it_is_given():
    stats, handles = JobStats(), job_handles()
    sync_job(stats, handles)
    rows = stats.rows(handles)
    text = render_table(rows, "pslaunch job j", 200, colour=False)
    for name in ("scheduler.0@localhost", "server.0@localhost", "worker.0@localhost", "worker.2@localhost"):
        assert name in text
    straggler_line = next(line for line in text.splitlines() if "worker.1@localhost" in line)
    assert "<< straggler" in straggler_line and "10%" in straggler_line and "\x1b" not in text
    cut = render_table(rows, "pslaunch job j", 200, colour=False, max_lines=7)
    assert cut.count("\n") <= 7 and "more processes" in cut


@pytest.mark.parametrize("width", [80, 100, 200])
def test_the_table_fits_the_terminal_dropping_the_least_useful_columns_and_keeping_process_state_and_note(width):
    stats, handles = JobStats(), job_handles()
    sync_job(stats, handles)
    title = "pslaunch job j: 1 server(s), 3 worker(s), 0:05; straggler: worker.1@localhost (waits 10% of the time)"
    text = render_table(stats.rows(handles), title, width, colour=False)
    lines = text.splitlines()
    assert all(len(line) <= width for line in lines), [len(line) for line in lines]
    assert "straggler: worker.1@localhost" in " ".join(lines[:2])  # the title wraps rather than losing it
    header = next(line for line in lines if line.lstrip().startswith("process"))
    for kept in ("process", "state", "push MB/s", "pull MB/s", "rounds/s", "note"):
        assert kept in header, header
    assert ("pulls waiting" in header) == (width >= 200) and ("rss" in header) == (width >= 200), header
    straggler_line = next(line for line in lines if line.startswith(" worker.1@localhost"))
    assert straggler_line.rstrip().endswith("<< straggler"), straggler_line


def test_the_dashboard_writes_the_lines_above_a_table_it_erases_and_draws_again_in_one_write():
    terminal = io.StringIO()
    board = Dashboard(terminal, lambda width, lines: "TABLE 1\nTABLE 2\n")
    board.resume()  # drawing, without the thread: each flush is a redraw
    board.write("stdout", "[worker.0@h] one\n")
    board.write("stdout", "[worker.0@h] two\n")
    board.flush()
    board.stop()
    assert terminal.getvalue() == ("TABLE 1\nTABLE 2\n"  # first drawn
                                   "\r\x1b[2F\x1b[J[worker.0@h] one\n[worker.0@h] two\nTABLE 1\nTABLE 2\n"
                                   "\r\x1b[2F\x1b[J")  # erased at the end


def test_a_dashboard_in_the_background_neither_erases_the_shells_lines_nor_draws_a_table_under_them():
    terminal, foreground = io.StringIO(), [True]
    board = Dashboard(terminal, lambda width, lines: "TABLE\n", holds_terminal=lambda: foreground[0])
    board.resume()
    assert terminal.getvalue() == "TABLE\n"
    foreground[0] = False  # Ctrl-Z stopped the script that ran pslaunch: its shell wrote "Stopped" and a prompt
    board.write("stdout", "[worker.0@h] late\n")
    board.flush()
    board.pause()
    assert terminal.getvalue() == "TABLE\n[worker.0@h] late\n"  # no cursor moved up over the shell's lines
    foreground[0] = True  # fg
    board.resume()
    board.stop()
    assert terminal.getvalue() == "TABLE\n[worker.0@h] late\nTABLE\n\r\x1b[1F\x1b[J"


def test_a_flood_of_lines_is_written_at_once_and_the_table_comes_back_at_the_next_redraw():
    terminal = io.StringIO()
    board = Dashboard(terminal, lambda width, lines: "TABLE\n")
    board.resume()
    flood = "[worker.0@h] " + "x" * (300 << 10) + "\n"
    board.write("stdout", flood)  # more than the dashboard holds for a redraw: out at once, table erased
    assert terminal.getvalue() == "TABLE\n\r\x1b[1F\x1b[J" + flood
    board.flush()
    assert terminal.getvalue().endswith(flood + "TABLE\n")
    board.stop()


def test_prometheus_text_has_help_type_and_a_labelled_sample_per_process_and_metric():
    stats, handles = JobStats(), job_handles()
    sync_job(stats, handles)
    text = render_metrics(stats.rows(handles), 'job "x"')
    assert "# TYPE pslaunch_worker_pushed_bytes_total counter" in text
    assert ('pslaunch_worker_pushed_bytes_total{job="job \\"x\\"",process="worker.0@localhost",role="worker",rank="0",'
            'host="localhost"} 8e+06') in text
    assert 'pslaunch_worker_straggler{job="job \\"x\\"",process="worker.1@localhost",role="worker",rank="1",' in text
    assert 'pslaunch_server_updates_total{job="job \\"x\\"",process="server.0@localhost"' in text
    assert 'pslaunch_up{job="job \\"x\\"",process="scheduler.0@localhost",role="scheduler",rank="0",host="localhost"} 1' in text


def test_the_metrics_server_answers_metrics_and_nothing_else_and_a_taken_port_is_an_error_naming_it():
    server = MetricsServer("127.0.0.1", 0, lambda: "pslaunch_up 1\n")
    try:
        url = f"http://127.0.0.1:{server.port}"
        with urllib.request.urlopen(url + "/metrics", timeout=10) as reply:
            assert reply.read() == b"pslaunch_up 1\n" and "version=0.0.4" in reply.headers["Content-Type"]
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(url + "/", timeout=10)
        assert info.value.code == 404
        with pytest.raises(ConfigError, match=f"--metrics-port: cannot listen on 127.0.0.1:{server.port}"):
            MetricsServer("127.0.0.1", server.port, lambda: "")
    finally:
        server.close()


def test_the_timeline_file_takes_arrays_of_events_leaves_out_bad_lines_and_ends_as_json(tmp_path):
    path = tmp_path / "trace.json"
    trace = TraceFile(str(path), "j1")
    event = {"name": "push w", "ph": "X", "ts": 1.5, "dur": 2.0, "pid": 4, "tid": 1}
    assert trace.take_line(json.dumps([event, {**event, "ts": 4.0}]))
    assert trace.take_line("[]")
    for bad in ("[{", '{"ph": "X"}', '[{"name": "x"}]', "[1, 2]"):
        assert not trace.take_line(bad)
    assert trace.close() == f"--timeline {path}: 4 line(s) of events could not be read and were left out"
    events = json.loads(path.read_text())
    assert events[0]["args"]["name"] == "pslaunch job j1" and events[1:] == [event, {**event, "ts": 4.0}]
    with pytest.raises(ConfigError, match="--timeline"):
        TraceFile(str(tmp_path / "no" / "such" / "dir.json"), "j")


def test_the_summary_names_the_root_cause_with_its_last_lines_and_each_process_with_exit_duration_and_bytes():
    stats, handles = JobStats(), job_handles()
    sync_job(stats, handles)
    handles[3].status = ExitStatus(code=1)
    for handle in handles[:3] + handles[4:]:
        handle.status = ExitStatus(code=75)

    class Lines:
        def last_lines(self, name):
            return ["Traceback (most recent call last):", "RuntimeError: boom"] if name == "worker.1@localhost" else []

    document = summary_document("j", stats.rows(handles), {"worker.1@localhost": "root cause"},
                                Failure("worker.1@localhost failed first: exit code 1", 1, handles[3]), 1, 12.5,
                                Lines())  # type: ignore[arg-type]
    assert document["ok"] is False and document["exit_code"] == 1
    assert document["root_cause"]["process"] == "worker.1@localhost"
    assert document["root_cause"]["last_lines"][-1] == "RuntimeError: boom"
    workers = {p["name"]: p for p in document["processes"] if p["role"] == "worker"}
    assert workers["worker.1@localhost"]["note"] == "root cause" and workers["worker.1@localhost"]["exit_code"] == 1
    assert workers["worker.0@localhost"]["pushed_bytes"] == 8e6 and workers["worker.0@localhost"]["rounds"] == 20
    json.dumps(document)  # plain JSON


def test_a_replacements_markers_are_read_and_a_malformed_one_loses_only_its_scalars():
    from launcher.supervision.replacements import ReplacementLog

    old, new, other = Handle("worker", 1, 103), Handle("worker", 1, 203), Handle("worker", 0, 204)
    old.status, old.ended = ExitStatus(code=None, signal=9), old.started + 2.0
    new.started = old.ended + 0.1
    log = ReplacementLog(old.started)
    log.add(old, new, 1)
    log.add(Handle("worker", 0, 104), other, 2)
    new.on_marker('RESUMED {"mark": 3, "scalars": {"step": 5}}')
    other.on_marker("RESUMED {not json")
    other.on_marker("RESUMED [1, 2]")  # only the first counts
    first, second = log.records()
    assert (first.resumed_from, first.caught_up_s, first.waited_s) == ({"step": 5}, None, None)
    assert second.resumed_from is None and second.resumed_s is not None
    new.on_marker("CAUGHT-UP")
    first = log.records()[0]
    assert first.waited_s == round(first.caught_up_s - first.ended_s, 3) and first.ended_s == 2.0
    assert first.describe().startswith("worker.1@localhost replaced in place at 2.0 s (signal SIGKILL; pid 103 -> 203, "
                                       "restart 1): resumed from its predecessor's last mark (step=5) ")
    assert "resumed from the beginning (no mark)" in log.records()[1].describe()
