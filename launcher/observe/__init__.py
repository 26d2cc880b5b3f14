"""What a person sees of a running job. Runs in pslaunch.

* ``output``: every process's lines, prefixed with who printed them, and ``--log-dir``'s files;
* ``terminal``: whether pslaunch holds its terminal (Ctrl-Z, the live table);
* ``jobstats``: what the scheduler's stats lines say of every process, turned into rows;
* ``dashboard``: the live table on a terminal; ``metrics``: ``--metrics-port``'s Prometheus text;
* ``timeline``: ``--timeline``'s Chrome / Perfetto trace;
* ``observer``: all of them for one job, and ``--summary-json``.

Nothing here starts or stops a process: the supervisor and the backends report what happens.
"""
