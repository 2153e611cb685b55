"""Operator tools on top of the handles and the runtime: the ``tensorhub`` command line, the
status view, transfer traces, admin requests to a running server, the demo and ``doctor``.
Nothing below this layer imports it.
"""
