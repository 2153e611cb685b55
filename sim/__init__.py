"""Discrete-event simulator (DESIGN.md §7): the production ``ReferenceTable``, ``scheduling``
policies and ``ReplicationSession`` against simulated clients, a virtual clock and a flow-level
network, at up to thousands of GPUs.

- :mod:`sim.core`: virtual clock, event queue, the one seeded random source, the trace digest.
- :mod:`sim.network`: links and flows, max-min fair sharing, re-solved per connected component.
- :mod:`sim.cluster`: datacenters, hosts of 8 GPUs, NICs, VPC NICs, paths, stragglers.
- :mod:`sim.actors`: the simulated server (the real table behind a simulated control plane)
  and clients (the real protocol and the real replication session).
- :mod:`sim.baselines`: NCCL, UCX and Ray object store models, parameters set once.
- :mod:`sim.scenarios`: the paper's experiments and a churn test; :mod:`sim.report` prints,
  saves and draws them; :mod:`sim.cli` is ``tensorhub sim``.
"""
