"""The pslaunch runtime nodes: transport, protocol, scheduler, server and worker over ZeroMQ."""
