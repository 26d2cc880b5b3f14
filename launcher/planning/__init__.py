"""Planning: which process of the job runs where, with which argv and environment. Runs in pslaunch.

* ``hostfile``: the ``-H`` file, parsed into hosts (``[user@]host[:sshport] [slots=N]`` per line);
* ``network``: the few looks at this machine a plan needs: the address every node dials for the
  scheduler, free ports, what ``--interface`` means here (``resolve``);
* ``plan``: ``make_plan``, a pure function of the resolved config: one ``ProcessSpec`` per process,
  what ``--dry-run`` prints.

Nothing here starts a process or knows a backend: a backend turns the plan into processes.
"""
