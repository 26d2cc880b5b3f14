"""The scheduler: one per job; it registers nodes, gives ranks and the address book, runs
barriers, watches liveness and ends the job in order.

- ``node``: the scheduler's loop (``Scheduler``).
- ``roster``: who registered, their ranks and liveness, and the barriers.
- ``rendezvous``: small values nodes leave for each other (NCCL's unique id).
- ``report``: the stats line for pslaunch and the scheduler's own timeline.
"""
