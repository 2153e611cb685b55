"""TensorHub's errors, under their public name (``tensorhub.errors``).

Every error a caller can see is a :class:`TensorHubError`, split by who is at fault; they are
defined in :mod:`tensorhub.core.errors` (the sans-IO core) and re-exported here unchanged, so
``except tensorhub.errors.VersionUnavailable`` catches exactly what the core raises.
"""

from tensorhub.core.errors import *  # noqa: F403
from tensorhub.core.errors import __all__  # noqa: F401
