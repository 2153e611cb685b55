"""TensorHub: reference-oriented storage for model weights in RL jobs.

The reference server stores no weights, only who holds which version; workers publish
references to tensors in their own memory and replicate versions by pulling directly from any
holder, becoming holders themselves.
"""

from . import errors
from .errors import TensorHubError

__version__ = "0.1.0"

__all__ = ["errors", "TensorHubError", "__version__"]
