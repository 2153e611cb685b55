"""Grant tokens: the capability a reader shows a holder to prove the server granted it a range.

Theory of operation
-------------------
The data plane is authenticated with one symmetric key per holder slot and one MAC per grant,
with no extra round trip:

- **The key.** A holder's engine draws a random key (32 bytes) for each registered shard and
  sends it to the server inside its ``Register`` (:attr:`tensorhub.core.messages.Register.grant_key`),
  over the control plane, which CURVE encrypts and authenticates when keys are configured. The
  server keeps it with the session and never sends it to anyone; a failover re-registers the
  same key with the next server. Readers never see a key.
- **The token.** Each ``Grant`` the server makes from that holder carries
  :meth:`GrantToken.seal` of ``(term, grant id, reader session, version, issued, ttl)`` under the
  holder's key: HMAC-SHA256 over a fixed label and those fields, cut to 16 bytes. The fields
  travel in clear in the token (61 bytes); only the MAC is secret-dependent.
- **The check.** The reader sends the token with its read requests (``tcp``: every request;
  ``local``/``nixl``: the describe that hands out the memory description; ``rdma_copy``: every
  stage request). The holder finds the key of the region asked for and asks
  :meth:`TokenChecker.check`: the MAC must verify under that key (so the token was made by the
  server for this holder slot: another slot's or another holder's token fails), the version
  must be the one asked for, the token must not have expired, and its term must be the term of
  the server the holder's session is on now (when the holder knows it): a grant of a server the
  holder left (a primary that stepped down, a server before its restart) admits nobody.
- **Expiry without synchronised clocks.** ``issued`` is the server's (monotonic) clock; holders
  do not share it. A :class:`TokenChecker` learns it from the tokens themselves: the issue time
  of the newest valid token of a server term, plus the local time elapsed since it was seen, is
  a lower bound of the server's clock now (lagging by a token's delivery time, which only makes
  expiry later). A token whose ``issued + ttl`` is below that bound is refused. The first token
  a holder sees from a term is judged by the MAC and version alone.
- **Cost.** A pull shows the same token with every request: the checker remembers the (key,
  token) pairs whose MAC verified (a bounded LRU), so later requests of the pull cost a lookup
  and the version and expiry comparisons (about a microsecond), not an HMAC.

What it binds: the holder slot (its key, so the region and the shard), the server term and
grant id, the reader's session, the version, and the validity period. What it does not bind:
who presents it (a token copied off the wire is good for the same version of the same holder
until it expires) and the byte range (a grant covers the whole shard).

This module is sans-IO: :mod:`hmac` and :mod:`hashlib` only; the clock is passed in.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["GrantToken", "InvalidToken", "KEY_BYTES", "TOKEN_BYTES", "TokenChecker", "valid_key"]

KEY_BYTES = 32  #: the size of a holder slot's key as the engine draws it
MIN_KEY_BYTES, MAX_KEY_BYTES = 16, 64  #: the sizes a Register may carry
_FORMAT = 1
_LABEL = b"tensorhub grant token v1\x00"
_BODY = struct.Struct("!BQQQQQI")  # format, term, grant, reader, version, issued (ms), ttl (ms)
_TAG_BYTES = 16
TOKEN_BYTES = _BODY.size + _TAG_BYTES  #: 61
_TERMS_KEPT = 8  # server terms a checker keeps a clock estimate for
_ADMITTED_KEPT = 4096  # verified (key, token) pairs a checker remembers, so a pull's later requests skip the MAC
_U64 = (1 << 64) - 1


class InvalidToken(ValueError):
    """A token that does not admit its bearer; the message says why (for the holder's log and
    the refusal counter). It never leaves the holder's process as such: transports turn it
    into their refusal (:class:`tensorhub.transports.base.Unauthorized` on the reader's side)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason  #: one word: no_token, malformed, forged, wrong_version, stale_term, expired, unknown_region


def valid_key(key: object) -> bool:
    """Whether ``key`` is usable as a holder slot's key (bytes of 16 to 64)."""
    return type(key) is bytes and MIN_KEY_BYTES <= len(key) <= MAX_KEY_BYTES


@dataclass(frozen=True, slots=True)
class GrantToken:
    """What the server vouches for in one grant (see the module docstring).

    Attributes:
        term: the server start that made the grant.
        grant: the grant id (unique within the term).
        reader: the reader's session id on that server.
        version: the version granted.
        issued: the server's clock when it granted (seconds; kept to the millisecond).
        ttl: seconds the token is good for after ``issued`` (kept to the millisecond).
    """

    term: int
    grant: int
    reader: int
    version: int
    issued: float
    ttl: float

    def _body(self) -> bytes:
        issued_ms = min(max(0, int(self.issued * 1000)), _U64)
        ttl_ms = min(max(1, int(self.ttl * 1000)), (1 << 32) - 1)
        try:
            return _BODY.pack(_FORMAT, self.term & _U64, self.grant & _U64, self.reader & _U64, self.version & _U64,
                              issued_ms, ttl_ms)  # fmt: skip
        except struct.error as err:  # pragma: no cover - every field is masked into range
            raise ValueError(f"grant token fields out of range: {err}") from None

    def seal(self, key: bytes) -> bytes:
        """The token: the fields and their MAC under ``key`` (a holder slot's key).

        Raises:
            ValueError: ``key`` is not 16 to 64 bytes.
        """
        if not valid_key(key):
            raise ValueError("a grant key is 16 to 64 bytes")
        body = self._body()
        return body + hmac.digest(key, _LABEL + body, "sha256")[:_TAG_BYTES]

    @classmethod
    def open(cls, key: bytes, token: object) -> GrantToken:
        """The fields of ``token`` if its MAC verifies under ``key``.

        Raises:
            InvalidToken: no token, a token of the wrong size or format, or a MAC that does not
                verify (made under another key, or altered).
        """
        if token is None:
            raise InvalidToken("no_token", "the request carries no grant token")
        if type(token) is not bytes or len(token) != TOKEN_BYTES:
            size = len(token) if isinstance(token, (bytes, bytearray, memoryview)) else type(token).__name__
            raise InvalidToken("malformed", f"a grant token is {TOKEN_BYTES} bytes, got {size}")
        body, tag = token[: _BODY.size], token[_BODY.size :]
        if not hmac.compare_digest(hmac.digest(key, _LABEL + body, "sha256")[:_TAG_BYTES], tag):
            raise InvalidToken("forged", "the grant token was not made for this holder (its MAC does not verify)")
        fmt, term, grant, reader, version, issued_ms, ttl_ms = _BODY.unpack(body)
        if fmt != _FORMAT:  # pragma: no cover - a MAC-valid token of another format would need the key
            raise InvalidToken("malformed", f"grant token format {fmt}, this holder reads {_FORMAT}")
        return cls(term, grant, reader, version, issued_ms / 1000.0, ttl_ms / 1000.0)


class TokenChecker:
    """The holder's check of grant tokens, with expiry judged by the server's clock as learned
    from the tokens (see the module docstring). Not thread-safe: the engine serialises calls.

    Args:
        clock: this process's monotonic clock (seconds), injected.
    """

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        #: term -> (the newest issue time seen, the local time it was seen): the server's clock
        self._server_time: OrderedDict[int, tuple[float, float]] = OrderedDict()
        #: (key, token) pairs whose MAC verified: a pull shows one token with every request
        self._verified: OrderedDict[tuple[bytes, bytes], GrantToken] = OrderedDict()

    def server_now(self, term: int) -> float | None:
        """A lower bound of the clock of the server of ``term`` now (None: no token seen yet)."""
        seen = self._server_time.get(term)
        if seen is None:
            return None
        issued, at = seen
        return issued + max(0.0, self._clock() - at)

    def check(self, key: bytes, token: object, version: int, term: int | None = None) -> GrantToken:
        """Admit ``token`` for ``version`` of the holder slot whose key is ``key``.

        Args:
            term: the term of the server the holder's session is registered with now (None:
                not known yet; the token's term is then not judged).

        Returns:
            The token's fields.

        Raises:
            InvalidToken: missing, malformed, forged (another slot's, or altered), for another
                version, of another server term, or expired.
        """
        blob = token if isinstance(token, bytes) else None
        known = self._verified.get((key, blob)) if blob is not None else None
        if known is None:
            t = GrantToken.open(key, token)
            if blob is not None:  # (it is: open() takes only bytes)
                self._verified[(key, blob)] = t
                if len(self._verified) > _ADMITTED_KEPT:
                    self._verified.popitem(last=False)
        else:
            t = known
        if t.version != version:
            raise InvalidToken("wrong_version", f"the grant token is for version {t.version}, not {version}")
        if term is not None and t.term != term:
            raise InvalidToken("stale_term", f"the grant token is of server term {t.term}; this holder answers to term {term}")
        now = self.server_now(t.term)
        if now is not None and t.issued + t.ttl < now:
            raise InvalidToken("expired", f"the grant token (grant {t.grant}) expired {now - t.issued - t.ttl:.1f} s ago")
        if now is None or t.issued > now:
            self._server_time[t.term] = (t.issued, self._clock())
            self._server_time.move_to_end(t.term)
            while len(self._server_time) > _TERMS_KEPT:
                self._server_time.popitem(last=False)
        return t
