"""Discrete-event simulator (DESIGN.md §7): runs the production ``ReferenceTable`` and
``scheduling`` policies against simulated clients, a virtual clock and a flow-level network.

Not built yet (its own issue). What it will drive already exists: the table is sans-IO, takes
an injected clock and random source, and reports its next deadline (``next_deadline()``), so a
simulator advances virtual time straight to it.
"""
