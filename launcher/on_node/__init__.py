"""What runs on the nodes, beside each process of the job, rather than in pslaunch.

pslaunch leaves a small program with the processes it starts, wherever they run:

* ``guard``: the POSIX-sh wrapper every process started over ssh (or by a Ray actor) runs in: its
  environment from stdin, its pid reported, pslaunch's verbs, and a stop when pslaunch goes silent;
* ``rank_shim``: what every rank of ``mpirun``, every task of a Slurm step and every process of an
  SGE job runs first (``python -m launcher.on_node.rank_shim``): the rank's process of the plan;
* ``sge_job``: the SGE job script's master and per-host agents;
* ``ray_actor``: the Ray actor that starts one process on its node;
* ``watchdog``: kills the job's process groups when pslaunch dies, even by SIGKILL;
* ``process_groups``: the five verbs pslaunch sends, what each does to a process group, and the one
  TERM, grace, KILL sequence every stop goes through (pslaunch's own teardown and the tests' too);
* ``children``: the environment and pipe of a child process; ``procfs``: what /proc says of a session.

Standard library (and the contract module, ``pscontract``) only, so that each starts fast on any
node: ``tests/test_imports.py`` imports every module here in a fresh interpreter and checks.
"""
