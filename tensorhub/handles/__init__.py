"""The handles: what an application holds (``tensorhub.open``, ``tensorhub.aio.open``).

:mod:`tensorhub.handles.api` holds the public names (the shard handle, sync and async, over the
runtime's client and engine actors) and, in its docstring, the map of the modules they are built
from. ``tensorhub.open`` and :mod:`tensorhub.aio` are its public names.
"""
