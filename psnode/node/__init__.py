"""What every node of a job shares, whatever its role.

- ``protocol``: the wire format (a 24-byte header frame, a meta frame, raw data frames).
- ``connection``: a node's bound transport, its own record, the address book and the scheduler
  link, which servers and workers build on.
- ``control``: the control plane's node side (registration, heartbeats, barriers, first failure).
- ``membership``: who is in the job and how to reach them (the address book).
- ``stats``: the counters a node reports with its heartbeats.
- ``timeline``: what a node did and when, as trace events.
- ``futures``: futures that complete after others (a step after the data, all of several).
"""
