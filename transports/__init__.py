"""Data-plane transports (DESIGN.md §6): the ``Transport`` plugin base class, the registry, and
the built-in transports (tcp, nixl, rdma_copy, local, memory).

Not built yet: the running system (issue 3) brings the base class, the registry and ``tcp``;
the data-plane and RDMA issues bring the rest. The reference table never imports this package:
it only carries each holder's transport endpoint, as plain msgpack data, to its readers.
"""
