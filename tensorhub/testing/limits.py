"""The suite's numbers: the distinctive region, version and fill byte its shards use, and its
time limits and sizes.

The suite reads ``_CLOSE_TIMEOUT`` and ``_COMMAND_TIMEOUT`` from this module when it uses them,
so a test shortens them here: ``monkeypatch.setattr(tensorhub.testing.limits, "_CLOSE_TIMEOUT", 0.5)``.
"""

from __future__ import annotations

# Distinctive numbers, so that an error message naming them is not a coincidence.
REGION, VERSION = 7919, 104729
SENTINEL = 0xAB
_READ_TIMEOUT = 20.0  # seconds any one read may take
_CLOSE_TIMEOUT = 10.0  # seconds any one close may take
_LONG_WAIT = 30.0  # a wait_timeout that a check must not have to sit out
_PROMPT = 10.0  # "promptly": well before _LONG_WAIT
_BOOT_TIMEOUT = 60.0  # seconds a holder process may take to start (spawn imports torch)
_COMMAND_TIMEOUT = 20.0  # seconds the holder process may take to answer a command
_QUIET_TIMEOUT = 5.0  # seconds the holder's background threads may take to stop
_PROTOCOL = 1  # of the pipe between the suite and its holder process
_WRITE_CHUNK = 4 << 20  # bytes of one write command
_MAX_FRAME = 16 << 20  # bytes of one frame on that pipe
