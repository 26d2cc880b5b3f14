"""psnode's test kit: whole jobs for tests, in processes or inside one process.

- ``LocalJob``: the scheduler, servers and worker scripts as real processes on 127.0.0.1, always
  reaped (``testkit.jobs``); the benchmarks start their jobs with it too.
- ``InProcJob``: the scheduler and servers on threads and worker nodes for the test to drive, all
  on the ``inproc`` transport: the protocol, rounds and request logic in milliseconds, no sockets.
- ``RecordingTransport``: the zmq transport noting what it sends and receives.

Every process's environment contract is written by ``pscontract``, its one writer.
"""

from .inproc import InProcJob
from .jobs import JobFailed, LocalJob, ProcessResult, free_port, job_env, wait_catching
from .processes import reap
from .recording import RecordingTransport, use_recording_transport

__all__ = [
    "LocalJob",
    "ProcessResult",
    "JobFailed",
    "free_port",
    "job_env",
    "reap",
    "wait_catching",
    "InProcJob",
    "RecordingTransport",
    "use_recording_transport",
]
