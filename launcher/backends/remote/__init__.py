"""How the backends reach hosts and check them before anything starts, shared by ssh and mpi (and
the local backend's checks of this machine):

- ``sshconn``: ssh connections (paramiko), pre-flight, the real names ssh config gives hosts.
- ``guard``: the remote guard every process started over ssh runs in.
- ``linkwatch``: pings over each guard's link, and a host lost when they stop.
- ``rsync``: ``--sync-dst-dir`` to every host.
- ``scriptcheck``: the user's script exists where it will run.
- ``checkpointdir``: every server host reaches ``--checkpoint-dir``.
"""
