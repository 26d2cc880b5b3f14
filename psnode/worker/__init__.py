"""A worker: sends key parts to the servers and completes futures when the replies arrive.

A push or a pull follows these modules in order:

- ``node``: the worker node (``WorkerNode``): what kvcore calls.
- ``data_path``: how a push or a pull becomes messages to the servers (``DataPath``).
- ``requests``: the requests in flight and how replies complete them.
- ``outbox``: how messages leave, in priority order.
- ``receiver``: which thread receives: the network thread, or a caller waiting for its reply.
- ``process``: a worker process's end (a clean close at exit, a crash reported to the job).
"""
