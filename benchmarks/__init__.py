"""pslaunch's benchmarks: ``python -m benchmarks.run`` (KVStore against MXNet and raw pyzmq) and friends.

Jobs start through ``testkit.LocalJob``, the same starter the tests use, with the
environment contract written by ``pscontract``. The worker scripts (``ps_worker.py``,
``mx_worker.py``) and ``zmq_ceiling.py`` run as scripts in their own processes and import only
``kv_suite`` beside them. docs/benchmarks.md has the method and the figures.
"""
