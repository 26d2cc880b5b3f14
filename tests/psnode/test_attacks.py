"""A job with a key against an attacker on the same host that has none: plain pyzmq, no psnode code.

The job (1 scheduler, 2 servers, 3 workers, real processes; tests/kvcore/dist_scripts/leaver_sums.py)
sums exact values while the attacker tries what worked before the job key existed: registering,
spoofing the departed worker 0 to ship an updater that writes a file and to push,
forging replies and an address book, joining as another job, streaming a huge frame. Every attempt
is refused before a message is parsed; the sums stay exact, nothing is written, no node grows.
"""

from __future__ import annotations

import os
import pickle
import re
import socket
import struct
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

from pscontract import new_job_key
from psnode.node.protocol import ENTRY_STRUCT, Cmd, pack_header, pack_json, pack_value
from testkit import LocalJob, job_env

SCRIPTS = Path(__file__).resolve().parents[1] / "kvcore" / "dist_scripts"
ALLREDUCE_SCRIPTS = Path(__file__).resolve().parents[1] / "kvcore" / "allreduce_scripts"
MIB = 1 << 20
# a ZMTP 3.0 greeting offering the NULL mechanism (what any ZeroMQ socket without credentials sends)
GREETING = b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" + b"\x00" * 31


class WritesAFile:
    """An 'updater' whose unpickling writes a file: proof of code execution if it ever arrives."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for pid {pid}")


def ports(job: LocalJob, workers: int) -> dict[str, list[int]]:
    """The TCP ports of the job's servers and workers, from their registration lines (PS_VERBOSE=1)."""
    found: dict[str, list[int]] = {}
    for role, count in (("server", 2), ("worker", workers)):
        for i in range(count):
            match = job.wait_for_line(role, i, rf"{role}@127\.0\.0\.1:(\d+) registering")
            found.setdefault(role, []).append(int(match.group(1)))
    return found


def stranger(ctx: zmq.Context, port: int, identity: bytes, plain: tuple[bytes, bytes] | None = None) -> zmq.Socket:
    """A DEALER of the attacker's, connected to ``port`` as ``identity`` (optionally offering PLAIN credentials)."""
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.identity = identity
    if plain is not None:
        sock.plain_username, sock.plain_password = plain
    sock.sndtimeo = 500  # once the job refused the connection a DEALER has no peer and a send would block
    sock.connect(f"tcp://127.0.0.1:{port}")
    return sock


def attempt(sock: zmq.Socket, frames: list) -> bool:
    """Send ``frames`` as the attacker; False when nothing can be queued any more (the job dropped the
    connection, as it should)."""
    try:
        sock.send_multipart(frames)
    except zmq.Again:
        return False
    return True


def test_without_the_key_nothing_gets_in_and_the_job_stays_exact(tmp_path):
    go, proof = tmp_path / "go", tmp_path / "code-ran"
    with LocalJob(3, 2, worker=[str(SCRIPTS / "leaver_sums.py"), str(go)], env={"PS_VERBOSE": "1"}) as job:
        found = ports(job, 3)
        leaver = next(i for i in range(3) if _wait_leaving(job, i))
        job.wait_for_line("worker", leaver, r"^LEAVING")
        assert job.of("worker", leaver).wait(30) == 0  # worker 0 left: its identity is free now
        departed = f"worker@127.0.0.1:{found['worker'][leaver]}".encode()
        servers = [job.of("server", i).pid for i in range(2)]
        before = [rss_kib(pid) for pid in servers]
        ctx = zmq.Context()
        try:
            sockets = []
            # registration with the scheduler, as a worker would, with no credentials and guessed ones
            reg = {"role": "worker", "host": "127.0.0.1", "port": 1, "uid": "worker@127.0.0.1:1",
                   "fingerprint": "x", "local_name": "x", "job_id": f"test-{job.port}"}
            for plain in (None, (f"test-{job.port}/worker@127.0.0.1:1".encode(), b"0" * 64)):
                sock = stranger(ctx, job.port, b"worker@127.0.0.1:1", plain)
                attempt(sock, [pack_header(Cmd.REGISTER), pack_json(reg)])
                sockets.append(sock)
            for port in found["server"]:
                # as the departed worker 0: an updater that runs code when unpickled, and pushes
                sock = stranger(ctx, port, departed)
                attempt(sock, [pack_header(Cmd.SET_UPDATER, 1, 1), pickle.dumps(WritesAFile(str(proof)))])
                for key, nbytes in ((0, 64), (1, 360000)):
                    entry = ENTRY_STRUCT.pack(key, 0, 0, 0, 0, nbytes, 1)
                    attempt(sock, [pack_header(Cmd.PUSH, 2, 1), entry, np.full(nbytes // 4, 1000, np.float32).tobytes()])
                sockets.append(sock)
            for i, port in enumerate(found["worker"]):
                if i == leaver:
                    continue
                # forged replies for every request id the worker may have pending, and a forged
                # address book from a "scheduler"
                sock = stranger(ctx, port, b"server@127.0.0.1:1")
                for req in range(1, 400):
                    if not attempt(sock, [pack_value(req, 0, np.full(16, 1e9, np.float32).tobytes())]):
                        break
                sockets.append(sock)
                book = {"rank": i, "nodes": [{"role": "server", "rank": 0, "host": "127.0.0.1", "port": 9, "uid": "evil",
                                              "fingerprint": "x", "local_name": "x"}]}
                fake = stranger(ctx, port, b"scheduler")
                attempt(fake, [pack_header(Cmd.ADDRBOOK), pack_json(book)])
                sockets.append(fake)
            # a frame that announces 8 GiB, then 384 MiB of it, to a server
            with socket.create_connection(("127.0.0.1", found["server"][0]), timeout=10) as raw:
                raw.sendall(GREETING + b"\x02" + struct.pack(">Q", 1 << 33))
                try:
                    for _ in range(384):
                        raw.sendall(b"\x00" * MIB)
                except OSError:
                    pass  # the server closed the connection: what should happen
            for sock in sockets:  # nobody answers the attacker
                assert not sock.poll(200), "the job answered a stranger"
                sock.close(0)
        finally:
            ctx.destroy(linger=0)  # a failure above may leave sockets with messages queued: never hang on them
        after = [rss_kib(pid) for pid in servers]
        go.write_text("go")
        results = job.wait(60)
    failed = [r for r in results if r.returncode != 0]
    assert not failed, "\n".join(map(str, failed))
    assert sum(r.output.count("OK ") for r in results if r.role == "worker") == 2  # exact sums
    assert not proof.exists(), "the attacker's updater ran"
    for pid_before, pid_after in zip(before, after):
        assert pid_after - pid_before < 8 * 1024, f"a server grew from {pid_before} to {pid_after} KiB"
    scheduler = next(r for r in results if r.role == "scheduler")
    assert "presented a wrong key" in scheduler.output, scheduler


def _wait_leaving(job: LocalJob, index: int) -> bool:
    try:
        job.wait_for_line("worker", index, r"^(LEAVING|READY)")
    except AssertionError:
        return False
    return "LEAVING" in job.output_of("worker", index)


def test_a_node_of_another_job_on_the_same_port_is_refused_and_both_sides_say_so(tmp_path):
    with LocalJob(1, 1, worker=[str(SCRIPTS / "garbage_sums.py"), str(tmp_path / "go")]) as job:
        job.wait_for_line("worker", None, r"^READY")
        code = "import kvcore; kvcore.create('dist_sync')"
        proc = job.start("intruder", 0, [sys.executable, "-c", code],
                         {"DMLC_ROLE": "worker", "PSLAUNCH_JOB_ID": "intruder", "PSLAUNCH_JOB_KEY": new_job_key()})
        proc.wait(60)
        (tmp_path / "go").write_text("go")
        results = job.wait(60)
    intruder_result = next(r for r in results if r.role == "intruder")
    assert intruder_result.returncode != 0
    assert re.search(rf"the scheduler at 127\.0\.0\.1:{job.port} refused this node's credentials", intruder_result.output)
    assert "job 'intruder'" in intruder_result.output, intruder_result
    scheduler = next(r for r in results if r.role == "scheduler")
    assert scheduler.returncode == 0, scheduler
    assert f"a node of job 'intruder' tried to join; this port belongs to job 'test-{job.port}'" in scheduler.output


@pytest.mark.parametrize("role", ["scheduler", "server"])
def test_a_job_on_a_network_address_without_a_key_refuses_to_start_naming_the_variables(role):
    address = next((a for a in _local_addresses() if not a.startswith("127.")), None)
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    env = job_env(1, 1, 9, {"DMLC_PS_ROOT_URI": address}, role=role)
    env.pop("PSLAUNCH_JOB_KEY", None)
    env["DMLC_PS_ROOT_URI"] = address
    env["DMLC_NODE_HOST"] = address
    import subprocess

    proc = subprocess.run([sys.executable, "-m", "psnode", role], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc
    assert f"refusing to start without a job key on a non-loopback address (DMLC_PS_ROOT_URI={address}" in proc.stderr
    assert "PSLAUNCH_JOB_KEY" in proc.stderr


def _local_addresses() -> list[str]:
    found = []
    for _, name in socket.if_nameindex():
        try:
            import fcntl

            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
                packed = fcntl.ioctl(sock.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))
            found.append(socket.inet_ntoa(packed[20:24]))
        except OSError:
            continue
    return found


def test_without_a_key_a_huge_frame_is_cut_off_before_it_is_buffered(tmp_path):
    go = tmp_path / "go"
    with LocalJob(1, 1, worker=[str(SCRIPTS / "garbage_sums.py"), str(go)], env={"PS_VERBOSE": "1"},
                  job_key=None) as job:
        job.wait_for_line("worker", None, r"^READY")
        port = int(job.wait_for_line("server", 0, r"server@127\.0\.0\.1:(\d+) registering").group(1))
        pid = job.of("server", 0).pid
        before = rss_kib(pid)
        with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
            raw.sendall(GREETING)
            raw.recv(64)  # the server's greeting
            ready = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
            raw.sendall(b"\x04" + bytes([len(ready)]) + ready)  # the NULL mechanism's READY command
            raw.sendall(b"\x02" + struct.pack(">Q", 1 << 33))
            sent = 0
            try:
                for _ in range(384):
                    raw.sendall(b"\x00" * MIB)
                    sent += 1
            except OSError:
                pass
        # What was sent is in the server's socket buffers or refused by now; 0.5 s more gives its
        # I/O thread time to take whatever it would take before the size is read.
        time.sleep(0.5)
        after = rss_kib(pid)
        go.write_text("go")
        results = job.wait(60)
    assert all(r.returncode == 0 for r in results), "\n".join(map(str, results))
    assert after - before < 8 * 1024, f"the server grew from {before} to {after} KiB while {sent} MiB streamed"


def _refused(raw: socket.socket) -> bool:
    """True once the job closed ``raw`` without a byte more than the handshake's answer."""
    raw.settimeout(15)
    try:
        while raw.recv(4096):
            pass
    except ConnectionResetError:
        pass
    return True


def test_a_stranger_on_a_workers_lane_port_is_refused_and_the_sums_stay_exact(tmp_path):
    go = tmp_path / "go"
    with LocalJob(2, 0, worker=[str(ALLREDUCE_SCRIPTS / "lane_sums.py"), str(go)],
                  env={"PSLAUNCH_SAME_HOST": "tcp"}) as job:
        lanes = [job.wait_for_line("worker", i, r"^LANE (\d+) (\S+)").groups() for i in range(2)]
        assert all(int(port) for port, _ in lanes), lanes
        for port, identity in lanes:
            with socket.create_connection(("127.0.0.1", int(port)), timeout=10) as raw:  # garbage
                try:
                    raw.sendall(b"\x00\xff" * 50000)
                except (ConnectionResetError, BrokenPipeError):
                    pass
                assert _refused(raw)
            with socket.create_connection(("127.0.0.1", int(port)), timeout=10) as raw:
                # a worker's opening, a proof made without the key, then a segment of 1e9s
                me, other = b"worker@127.0.0.1:1", identity.encode()
                raw.sendall(b"PSLANE\x01\x00" + struct.pack("<H", len(me)) + me + struct.pack("<H", len(other))
                            + other + b"\x00" * 16)
                assert len(raw.recv(48, socket.MSG_WAITALL)) == 48  # the worker's nonce and proof: it took the opening
                try:
                    raw.sendall(b"\x00" * 32 + np.full(300_001, 1e9, np.float32).tobytes())
                except (ConnectionResetError, BrokenPipeError):
                    pass  # refused while the segment was still going out
                assert _refused(raw)
        go.write_text("go")
        results = job.wait(60)
    failed = [r for r in results if r.returncode != 0]
    assert not failed, "\n".join(map(str, failed))
    workers = [r for r in results if r.role == "worker"]
    assert sum(r.output.count("OK ") for r in workers) == 2  # exact sums, on lanes
    assert all(int(re.search(r"lane messages (\d+)", r.output).group(1)) > 0 for r in workers)
    for r in workers:
        assert "refused a lane from 127.0.0.1" in r.output, r
