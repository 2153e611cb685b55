"""The handles: what an application holds (``tensorhub.open``, ``tensorhub.aio.open``).

:mod:`tensorhub.handles.api` is the shard handle, sync and async, over the runtime's client and
engine actors. ``tensorhub.open`` and :mod:`tensorhub.aio` are its public names.
"""
