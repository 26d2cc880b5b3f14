"""A shared-memory reference comes from the network: a server maps only its sender's regions of this job."""

import os
import subprocess
import sys
import tempfile

import numpy as np
import pytest

from psnode import shm


def test_a_region_of_this_job_from_its_sender_is_mapped_and_shared():
    tag = shm.job_tag("job-a")
    region = shm.Region(4096, tag)
    view = shm.Attachments(tag).view(region.ref, 4096, os.getpid())
    view[:4] = [1, 2, 3, 4]
    assert region.array[:4].tolist() == [1, 2, 3, 4]


def test_a_reference_to_another_process_than_the_sender_is_refused_naming_both():
    tag = shm.job_tag("job-a")
    region = shm.Region(64, tag)
    with pytest.raises(shm.RefusedRegion, match=rf"process {os.getpid()}, but its sender is process 1\b"):
        shm.Attachments(tag).view(region.ref, 64, 1)


def test_a_reference_to_a_regular_file_is_refused_and_the_file_is_untouched():
    with tempfile.NamedTemporaryFile() as handle:
        handle.write(b"precious")
        handle.flush()
        fd = os.open(handle.name, os.O_RDONLY)  # a file this process holds open read-only
        try:
            with pytest.raises(shm.RefusedRegion, match="not a shared-memory region of this job"):
                shm.Attachments(shm.job_tag("job-a")).view(shm.encode(os.getpid(), fd), 8, os.getpid())
        finally:
            os.close(fd)
        assert open(handle.name, "rb").read() == b"precious"


def test_a_region_of_another_job_is_refused():
    region = shm.Region(64, shm.job_tag("job-b"))
    with pytest.raises(shm.RefusedRegion, match="not a shared-memory region of this job"):
        shm.Attachments(shm.job_tag("job-a")).view(region.ref, 64, os.getpid())


def test_a_region_smaller_than_the_part_is_refused():
    tag = shm.job_tag("job-a")
    region = shm.Region(64, tag)
    with pytest.raises(shm.RefusedRegion, match="has 64 bytes, not 4096"):
        shm.Attachments(tag).view(region.ref, 4096, os.getpid())


def test_references_to_gone_or_foreign_descriptors_fail_cleanly_without_crashing():
    attachments = shm.Attachments(shm.job_tag("job-a"))
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    for ref, pid in [(shm.encode(child.pid, 3), child.pid), (shm.encode(1, 0), 1), (shm.encode(os.getpid(), 999999), os.getpid())]:
        with pytest.raises((OSError, shm.RefusedRegion)):
            attachments.view(ref, 8, pid)
    assert not shm.can_attach(shm.encode(1, 0), 1, attachments.tag)
    probe = shm.probe("job-a")
    assert shm.can_attach(probe.ref, os.getpid(), attachments.tag)
    assert np.all(probe.array == 0x5A)
