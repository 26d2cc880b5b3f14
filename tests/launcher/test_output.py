"""Output handling: line splitting, progress bars, bad UTF-8, prefixes, mpirun tag demultiplexing."""

from __future__ import annotations

import io
import re

import pytest

from launcher.backends.mpi import TagDemux
from launcher.config import parse_ranks_option
from launcher.errors import ConfigError
from launcher.observe.output import RANK_COLOURS, LineSplitter, Printer

pytestmark = pytest.mark.unit


def _split(chunks, clock=None):
    lines = []
    times = iter(clock or [0.0] * 100)
    s = LineSplitter(lines.append, clock=lambda: next(times))
    for c in chunks:
        s.feed(c)
    s.close()
    return lines


def test_partial_lines_are_joined_and_the_last_one_flushed_at_eof():
    assert _split([b"hel", b"lo\nwor", b"ld\r\n", b"tail"]) == ["hello", "world", "tail"]


def test_invalid_utf8_is_replaced_not_fatal():
    assert _split([b"ok \xff\xfe \xc3\n", "ü\n".encode()]) == ["ok \ufffd\ufffd \ufffd", "ü"]


def test_carriage_return_progress_shows_at_most_once_a_second_and_its_final_state():
    chunks = [b"10%\r", b"20%\r", b"30%\r", b"40%\r", b"100%\n"]
    # clock: first update at t=0 shown, t=0.5 and 0.9 hidden, t=1.2 shown; newline shows the final state
    assert _split(chunks, clock=[0.0, 0.5, 0.9, 1.2]) == ["10%", "40%", "100%"]


def test_printer_prefixes_plain_without_tty_and_coloured_on_request_and_keeps_last_lines(tmp_path):
    out, err = io.StringIO(), io.StringIO()
    p = Printer(out=out, err=err, colour=False, log_dir=str(tmp_path), keep_lines=2)
    for i in range(3):
        p.line("worker.0@h", "worker", f"line {i}")
    p.line("server.0@h", "server", "oops", "stderr")
    p.close()
    assert out.getvalue().splitlines() == ["[worker.0@h] line 0", "[worker.0@h] line 1", "[worker.0@h] line 2"]
    assert err.getvalue() == "[server.0@h] oops\n"
    assert p.last_lines("worker.0@h") == ["line 1", "line 2"]
    assert (tmp_path / "worker.0@h.log").read_text() == "line 0\nline 1\nline 2\n"
    coloured = Printer(out=io.StringIO(), colour=True)
    # a colour per worker rank (neighbours differ), one per role for the others
    workers = [coloured.prefix(f"worker.{r}@h", "worker") for r in range(len(RANK_COLOURS))]
    assert workers[1] == "\x1b[34m[worker.1@h]\x1b[0m" and len({w.split("[w")[0] for w in workers}) == len(workers)
    assert coloured.prefix(f"worker.{len(RANK_COLOURS)}@h", "worker").startswith(f"\x1b[{RANK_COLOURS[0]}m")
    assert coloured.prefix("server.1@h", "server") == "\x1b[36m[server.1@h]\x1b[0m"


def test_tag_demux_routes_partial_chunks_and_tags_cut_between_reads():
    got = []
    demux = TagDemux(lambda rank, stream, data: got.append((rank, stream, data)))
    stream = b"mpirun says hi\n[1,0]<stdout>:a[1,1]<stdout>:a[1,0]<stdout>:b\n[1,1]<stderr>:x [y]\n"
    for i in range(0, len(stream), 5):  # reads that cut tags in pieces
        demux.feed(stream[i : i + 5])
    demux.close()
    joined: dict = {}
    for rank, s, data in got:
        joined[(rank, s)] = joined.get((rank, s), b"") + data
    assert joined == {(None, None): b"mpirun says hi\n", (0, "stdout"): b"ab\n", (1, "stdout"): b"a",
                      (1, "stderr"): b"x [y]\n"}


def test_progress_state_hidden_by_the_throttle_is_shown_when_the_line_ends():
    # each update arrives alone; only the first passes the throttle; the newline shows the last
    assert _split([b"a 10%\r", b"a 50%\r", b"a 100%\r", b"\n", b"next\n"], clock=[0.0, 0.1, 0.2]) == [
        "a 10%", "a 100%", "next"]


def test_crlf_split_across_reads_gives_one_line_and_blank_lines_stay():
    assert _split([b"text\r", b"\n", b"\n", b"end\r\n"]) == ["text", "", "end"]


def test_plain_lines_come_as_blocks_and_a_line_over_the_bound_comes_in_pieces_of_the_bound():
    blocks = []
    s = LineSplitter(blocks.append, max_line=10)
    s.feed(b"one\ntwo\nthr")
    s.feed(b"ee\n" + b"x" * 25)
    s.feed(b"y\n")
    s.close()
    assert blocks == ["one\ntwo", "three", "x" * 10, "x" * 10, "xxxxxy"]


def test_printer_prefixes_every_line_of_a_block_and_keeps_its_last_lines():
    out = io.StringIO()
    p = Printer(out=out, err=io.StringIO(), colour=False, keep_lines=2)
    p.lines("w.0@h", "worker", "a\nb\nc")
    p.flush()
    assert out.getvalue() == "[w.0@h] a\n[w.0@h] b\n[w.0@h] c\n"
    assert p.last_lines("w.0@h") == ["b", "c"]
    p.close()


def test_untagged_text_after_a_ranks_line_is_mpiruns_own():
    got = []
    demux = TagDemux(lambda rank, stream, data: got.append((rank, data)))
    demux.feed(b"[1,1]<stderr>:Traceback\nPrimary job terminated normally\n[1,1]<stderr>:part")
    demux.feed(b"ial\nmpirun noticed\n")
    demux.close()
    joined: dict = {}
    for rank, data in got:
        joined[rank] = joined.get(rank, b"") + data
    assert joined == {1: b"Traceback\npartial\n", None: b"Primary job terminated normally\nmpirun noticed\n"}


def test_ranks_keep_other_workers_off_the_screen_but_in_their_logs_and_last_lines(tmp_path):
    out = io.StringIO()
    p = Printer(out=out, err=io.StringIO(), colour=False, log_dir=str(tmp_path), ranks=frozenset({0, 3}))
    for rank in range(5):
        p.line(f"worker.{rank}@h", "worker", f"hello {rank}")
    p.line("server.1@h", "server", "a server's line still shows")
    p.close()
    assert out.getvalue().splitlines() == ["[worker.0@h] hello 0", "[worker.3@h] hello 3",
                                           "[server.1@h] a server's line still shows"]
    assert (tmp_path / "worker.1@h.log").read_text() == "hello 1\n" and p.last_lines("worker.4@h") == ["hello 4"]


def test_timestamps_start_every_line_of_a_block_with_the_time():
    out = io.StringIO()
    p = Printer(out=out, err=io.StringIO(), colour=False, timestamps=True)
    p.lines("worker.0@h", "worker", "a\nb")
    p.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and all(re.fullmatch(r"\d\d:\d\d:\d\d\.\d{3} \[worker\.0@h\] [ab]", line) for line in lines)


@pytest.mark.parametrize("text,ranks", [("0", {0}), ("0,3-5", {0, 3, 4, 5}), (" 2 , 1-1 ", {1, 2})])
def test_ranks_are_a_list_of_ranks_and_ranges(text, ranks):
    assert parse_ranks_option(text) == ranks


@pytest.mark.parametrize("text", ["", "a", "1,", "3-1", "-2", "1-"])
def test_a_malformed_rank_list_is_an_error_naming_it(text):
    with pytest.raises(ConfigError, match=r"--ranks .*is not a rank or a range of ranks"):
        parse_ranks_option(text)
