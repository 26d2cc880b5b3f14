"""Reaching hosts over ssh: the ssh backend, and what the mpi backend shares of it.

* ``backend``: ``--launcher ssh``: every remote process on a paramiko channel, under the guard;
* ``connection``: ssh connections, the pre-flight check of every host, the names ssh config gives
  them, and whether every host reaches the scheduler's address;
* ``linkwatch``: pings over each guard's link, and a host lost when they stop;
* ``rsync``: ``--sync-dst-dir`` to every host.
"""
