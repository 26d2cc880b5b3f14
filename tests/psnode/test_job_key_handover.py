"""The job key's way from pslaunch to the runtime: a pipe (pscontract.hand_key_over) read once by the
runtime (psnode.transport.security), never an environment variable of the process."""

from __future__ import annotations

import os

import pytest

from pscontract import PSLAUNCH_JOB_KEY, PSLAUNCH_JOB_KEY_FD, hand_key_over
from psnode.transport.security import EnvError, read_job_key, take_job_key

pytestmark = pytest.mark.unit

KEY = "ab" * 32


def test_the_key_moves_from_the_environment_into_a_pipe_the_runtime_reads_once():
    env = {PSLAUNCH_JOB_KEY: KEY, "OTHER": "1"}
    fd = hand_key_over(env)
    assert fd is not None and env == {PSLAUNCH_JOB_KEY_FD: str(fd), "OTHER": "1"}  # a number, not the key
    assert take_job_key(env) == bytes.fromhex(KEY)
    assert PSLAUNCH_JOB_KEY_FD not in env  # a child of this process would find nothing
    with pytest.raises(OSError):
        os.fstat(fd)  # read to its end and closed


def test_an_environment_without_a_key_gets_no_pipe():
    env = {"OTHER": "1"}
    assert hand_key_over(env) is None and env == {"OTHER": "1"}


@pytest.mark.parametrize(("value", "why"), [
    ("x", r"PSLAUNCH_JOB_KEY_FD='x' is not a file descriptor number"),
    ("987654", r"PSLAUNCH_JOB_KEY_FD=987654 cannot be read: Bad file descriptor"),
])
def test_a_bad_descriptor_is_an_error_naming_it(value, why):
    with pytest.raises(EnvError, match=why):
        read_job_key({PSLAUNCH_JOB_KEY_FD: value})


def test_a_malformed_key_in_the_pipe_is_refused_without_showing_it():
    env = {PSLAUNCH_JOB_KEY: "zz-secret-zz"}
    hand_key_over(env)
    with pytest.raises(EnvError) as refused:
        read_job_key(env)
    assert "PSLAUNCH_JOB_KEY_FD=" in str(refused.value) and "zz-secret-zz" not in str(refused.value)


def test_two_ways_of_giving_the_key_at_once_are_refused():
    env = {PSLAUNCH_JOB_KEY: KEY}
    fd = hand_key_over(env)
    try:
        with pytest.raises(EnvError, match="PSLAUNCH_JOB_KEY and PSLAUNCH_JOB_KEY_FD are all set"):
            read_job_key({**env, PSLAUNCH_JOB_KEY: KEY})
    finally:
        os.close(fd)
