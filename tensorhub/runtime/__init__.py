"""The actor runtime: where IO lives.

The reference server actor (a ZeroMQ ROUTER around the core's reference table), the client
actor (DEALER, heartbeats, failover), the transfer engine actor (registered buffers, progress,
the transports), the actor base and its event-loop thread, checksums (threads over registered
memory), the embedded default server, CURVE keys and Prometheus metrics. It builds on the core,
the scheduling policies and the transports; the handles build on it.
"""
