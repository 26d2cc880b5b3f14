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
    with pytest.raises(same_host.RefusedRegion, match="has 64 bytes, not 4096"):
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
