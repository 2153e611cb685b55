"""Discrete-event simulator (DESIGN.md §7): the production ``ReferenceTable``, ``scheduling``
policies and ``ReplicationSession`` against simulated clients, a virtual clock and a flow-level
network, at up to thousands of GPUs.

- :mod:`tensorhub.sim.core`: virtual clock, event queue, the one seeded random source, the trace digest.
- :mod:`tensorhub.sim.network`: links and flows, max-min fair sharing, re-solved per connected component.
- :mod:`tensorhub.sim.cluster`: datacenters, hosts of 8 GPUs, NICs, VPC NICs, paths, stragglers.
- :mod:`tensorhub.sim.actors`: the simulated server (the real table behind a simulated control plane)
  and clients (the real protocol and the real replication session).
- :mod:`tensorhub.sim.baselines`: NCCL, UCX and Ray object store models, parameters set once.
- :mod:`tensorhub.sim.reshard`: resharding (bf16 trainers -> fp8 engines) at the Perplexity write-up's shapes.
- :mod:`tensorhub.sim.deltas`: cross-datacenter replication with deltas (issue 21), full seeding against deltas per version.
- :mod:`tensorhub.sim.scenarios`: the paper's experiments and a churn test; :mod:`tensorhub.sim.report` prints,
  saves and draws them; :mod:`tensorhub.sim.cli` is ``tensorhub sim``.
"""
