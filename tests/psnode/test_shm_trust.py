"""A shared-memory reference comes from the network: a server maps only its sender's regions of this job."""

import os
import subprocess
import sys
import tempfile

import numpy as np
import pytest

from psnode.transport import same_host


def test_a_region_of_this_job_from_its_sender_is_mapped_and_shared():
    tag = same_host.job_tag("job-a")
    region = same_host.Region(4096, tag)
    view = same_host.Attachments(tag).view(region.ref, 4096, os.getpid())
    view[:4] = [1, 2, 3, 4]
    assert region.array[:4].tolist() == [1, 2, 3, 4]


def test_a_reference_to_another_process_than_the_sender_is_refused_naming_both():
    tag = same_host.job_tag("job-a")
    region = same_host.Region(64, tag)
    with pytest.raises(same_host.RefusedRegion, match=rf"process {os.getpid()}, but its sender is process 1\b"):
        same_host.Attachments(tag).view(region.ref, 64, 1)


def test_a_reference_to_a_regular_file_is_refused_and_the_file_is_untouched():
    with tempfile.NamedTemporaryFile() as handle:
        handle.write(b"precious")
        handle.flush()
        fd = os.open(handle.name, os.O_RDONLY)  # a file this process holds open read-only
        try:
            with pytest.raises(same_host.RefusedRegion, match="not a shared-memory region of this job"):
                same_host.Attachments(same_host.job_tag("job-a")).view(same_host.encode(os.getpid(), fd), 8, os.getpid())
        finally:
            os.close(fd)
        assert open(handle.name, "rb").read() == b"precious"


def test_a_region_of_another_job_is_refused():
    region = same_host.Region(64, same_host.job_tag("job-b"))
    with pytest.raises(same_host.RefusedRegion, match="not a shared-memory region of this job"):
        same_host.Attachments(same_host.job_tag("job-a")).view(region.ref, 64, os.getpid())


def test_a_region_smaller_than_the_part_is_refused():
    tag = same_host.job_tag("job-a")
    region = same_host.Region(64, tag)
    with pytest.raises(same_host.RefusedRegion, match="has 72 bytes, not 4096"):  # 64 and its receipt
        same_host.Attachments(tag).view(region.ref, 4096, os.getpid())


def test_references_to_gone_or_foreign_descriptors_fail_cleanly_without_crashing():
    attachments = same_host.Attachments(same_host.job_tag("job-a"))
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    for ref, pid in [(same_host.encode(child.pid, 3), child.pid), (same_host.encode(1, 0), 1), (same_host.encode(os.getpid(), 999999), os.getpid())]:
        with pytest.raises((OSError, same_host.RefusedRegion)):
            attachments.view(ref, 8, pid)
    assert not same_host.can_attach(same_host.encode(1, 0), 1, attachments.tag)
    probe = same_host.probe("job-a")
    assert same_host.can_attach(probe.ref, os.getpid(), attachments.tag)
    assert np.all(probe.array == 0x5A)


# ---- a worker reading a value a reply says lies in its server's memory -----------------------------

def _pull_of_one_part(server_memory: bool):
    """A worker's request table with one pull of a 4096-byte part asked for in shared memory."""
    import concurrent.futures

    from psnode.worker.requests import RequestTable

    class Latch:
        error = None

    table = RequestTable(Latch())
    tag = same_host.job_tag("job-a")
    if server_memory:
        table.server_memory = same_host.Attachments(tag)
    out = np.zeros(1024, np.float32)
    future = concurrent.futures.Future()
    req = table.track(future, 1, [memoryview(out).cast("B")], "pull", 0)
    region = same_host.Region(4096, tag)  # the part's pull region, its receipt cell after the value
    table.pending[req].regions = {0: region}
    return table, req, out, future, region


def _reply(req: int, ref: int, receipt: int, frame: int = same_host.IN_SERVER_MEMORY):
    from psnode.compression.codecs import RAW
    from psnode.node.protocol import Cmd, pack_entries, pack_header
    from psnode.transport.base import Frame

    return [Frame(memoryview(pack_header(Cmd.PULL_REPLY, req))),
            Frame(memoryview(pack_entries([(7, 0, frame, RAW, ref, 4096, receipt)]))), Frame(memoryview(b""))]


def _server(pid: int):
    from psnode.node.membership import PeerInfo

    return PeerInfo("server", 0, "127.0.0.1", 4000, "server-0", "fp", "", 0, pid=pid)


def test_a_worker_copies_a_value_out_of_its_servers_region_and_writes_the_receipt_it_was_given():
    from psnode.node.protocol import Cmd

    table, req, out, future, region = _pull_of_one_part(server_memory=True)
    value = same_host.Region(4096, same_host.job_tag("job-a"))  # the server's (this process plays it)
    value.array.view(np.float32)[:] = 2.5
    table.take_reply(_server(os.getpid()), Cmd.PULL_REPLY, 0, req, 0, _reply(req, value.ref, 41))
    assert future.done() and future.exception() is None and np.all(out == 2.5)
    assert int(region.receipt[0]) == 41 and table.from_server_memory == 1


@pytest.mark.parametrize("case", ["other-process", "other-job", "not-asked", "no-shared-memory"])
def test_a_reply_naming_a_region_the_worker_must_not_read_fails_the_pull_naming_the_server(case):
    from psnode.errors import ProtocolError
    from psnode.node.protocol import Cmd

    table, req, out, future, region = _pull_of_one_part(server_memory=case != "no-shared-memory")
    value = same_host.Region(4096, same_host.job_tag("job-b" if case == "other-job" else "job-a"))
    if case == "not-asked":
        table.pending[req].regions = None
    pid = 1 if case == "other-process" else os.getpid()
    with pytest.raises(ProtocolError):
        table.take_reply(_server(pid), Cmd.PULL_REPLY, 0, req, 0, _reply(req, value.ref, 41))
    assert isinstance(future.exception(timeout=1), ProtocolError)
    message = str(future.exception())
    assert "server 0" in message, message
    assert np.all(out == 0) and int(region.receipt[0]) == 0
