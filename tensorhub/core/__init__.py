"""The sans-IO core: what TensorHub decides, with no IO.

Names and errors, the wire format and its messages, layouts and packing plans, placements (which
part of a tensor's global shape each shard holds), the holder lifecycle, the topology vocabulary,
the reference table (the server's whole logic), the reader's replication session and the table's
invariants. Every module here takes events and returns actions or values; none imports asyncio,
zmq, socket, threading, subprocess or multiprocessing (``tests/test_architecture.py`` enforces
it). The server actor, the client, the simulator and the property tests all drive these same
classes.
"""
