"""Supervision: watching a job's processes to their end. Runs in pslaunch.

* ``supervisor``: runs a plan through a backend, watches every process, stops everything on the
  first real failure (TERM, grace, KILL), handles Ctrl-C / Ctrl-Z, ``--timeout`` and restarts;
* ``verdict``: why a job ended, as data: the root cause among the processes and each row's note;
* ``restarts``: ``--max-restarts``' budget and the attempts it made;
* ``result``: ``RunResult``, what ``launch()`` returns and the command prints;
* ``summary``: the table printed when the job ends;
* ``agent``: pslaunch as a per-node agent on node R > 0 (``--nnodes``): it supervises its node's share
  for node 0.
"""
