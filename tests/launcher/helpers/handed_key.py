"""What the test helpers read for ``PSLAUNCH_JOB_KEY``: the variable, or else what pslaunch handed over in
its place, the pipe ``PSLAUNCH_JOB_KEY_FD`` names (the key is never in the environment of a process
pslaunch starts). Read as text, as it travelled: a forwarded value need not be a valid key."""

import os


def handed_value(name):
    if name == "PSLAUNCH_JOB_KEY" and name not in os.environ and "PSLAUNCH_JOB_KEY_FD" in os.environ:
        with os.fdopen(int(os.environ["PSLAUNCH_JOB_KEY_FD"]), "rb") as pipe:
            return pipe.read().decode().strip()
    return os.environ.get(name)
