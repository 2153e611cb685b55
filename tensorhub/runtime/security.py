"""Control-plane security: ZeroMQ CURVE keys, the server's allow list, and the loopback rule.

Theory of operation
-------------------
Keys are ZeroMQ certificate files (``tensorhub keygen``): ``NAME.key`` holds the public key,
``NAME.key_secret`` the public and secret keys. A server started with its secret key
(``--curve-secret``) and a set of allowed client public keys (``--curve-clients``: a directory
of ``*.key`` files, or one file) runs every connection through CURVE: a peer that does not
speak CURVE, or whose key is not allowed, never gets a message through (the handshake fails).
A small ZAP handler (:class:`KeyAuthenticator`) decides, counts refusals, and names each
accepted connection by its public key (the ``User-Id`` of its messages), which the server
uses to bind sessions to the key that opened them.

Clients (handles, ``tensorhub status``...) use CURVE when ``$TENSORHUB_CURVE_SERVER_KEY``
names the server's public key (a ``.key`` file or the 40-character Z85 key) and
``$TENSORHUB_CURVE_SECRET`` names their own ``.key_secret`` file; see :func:`client_keys`.

Binding: the server binds loopback by default; a non-loopback bind without keys is refused
unless the operator says ``insecure`` (:func:`check_bind`).

Authorization by model (:class:`ModelPolicy`, ``--model-policy FILE``, CURVE only): a TOML file
of rules, each mapping model name patterns to the client keys that may *publish* them (publish,
announce holdings after a failover, convert into them, declare bucket copies) and those that may
*read* them (open, replicate, update, list, wait). The first rule whose pattern matches the
model decides; a model no rule matches is refused to every key. A key is named by its file name
in ``--curve-clients`` (``alice`` for ``alice.key``) or by its 40-character Z85 public key;
``"*"`` is every admitted key. Publishing implies reading. A delta model (``m@delta``) follows
the rules of ``m``.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio
import zmq.utils.z85

from tensorhub.core.errors import InvalidArgument

__all__ = [
    "ClientKeys",
    "KeyAuthenticator",
    "ModelPolicy",
    "ServerKeys",
    "check_bind",
    "client_keys",
    "is_loopback",
    "keygen",
    "load_allowed",
    "load_public",
    "load_secret",
]

ENV_SERVER_KEY = "TENSORHUB_CURVE_SERVER_KEY"
ENV_SECRET = "TENSORHUB_CURVE_SECRET"
_Z85_KEY = re.compile(rb"^[0-9a-zA-Z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}$")
MAX_ALLOWED_KEYS = 100_000


def _read_cert(path: str | os.PathLike, what: str) -> tuple[bytes, bytes | None]:
    import zmq.auth

    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as err:
        raise InvalidArgument(f"{what}: cannot read a ZeroMQ certificate from {str(path)!r}: {err}") from None
    if not _Z85_KEY.match(public) or (secret is not None and not _Z85_KEY.match(secret)):
        raise InvalidArgument(f"{what}: {str(path)!r} holds no valid 40-character Z85 CURVE key")
    return public, secret


def load_public(spec: str, what: str = "public key") -> bytes:
    """A public key from ``spec``: the 40-character Z85 key itself, or a certificate file.

    Raises:
        InvalidArgument: neither (named).
    """
    raw = spec.encode() if isinstance(spec, str) else b""
    if _Z85_KEY.match(raw) and not os.path.exists(spec):
        return raw
    return _read_cert(spec, what)[0]


def load_secret(path: str, what: str = "secret key") -> tuple[bytes, bytes]:
    """(public, secret) from a ``.key_secret`` certificate file.

    Raises:
        InvalidArgument: no such file, or it holds no secret key.
    """
    public, secret = _read_cert(path, what)
    if secret is None:
        raise InvalidArgument(f"{what}: {path!r} holds only a public key; give the .key_secret file")
    return public, secret


def load_allowed(spec: str) -> frozenset[bytes]:
    """The allowed client public keys: every ``*.key`` file of a directory, or one file.

    Raises:
        InvalidArgument: nothing readable, or no key at all.
    """
    p = Path(spec)
    if p.is_dir():
        files = sorted(f for f in p.iterdir() if f.suffix == ".key" and f.is_file())
    elif p.is_file():
        files = [p]
    else:
        raise InvalidArgument(f"allowed client keys: {spec!r} is neither a directory of .key files nor a file")
    if len(files) > MAX_ALLOWED_KEYS:
        raise InvalidArgument(f"allowed client keys: {len(files)} files in {spec!r}; at most {MAX_ALLOWED_KEYS}")
    keys = frozenset(_read_cert(f, "allowed client key")[0] for f in files)
    if not keys:
        raise InvalidArgument(f"allowed client keys: no .key file in {spec!r}")
    return keys


def keygen(directory: str, name: str) -> tuple[str, str]:
    """Write a new key pair: ``DIR/NAME.key`` (public) and ``DIR/NAME.key_secret`` (mode 0600).

    Returns:
        (public file, secret file).

    Raises:
        InvalidArgument: a bad name, or the files exist already (never overwritten).
    """
    import zmq.auth

    if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name) or name.startswith("."):
        raise InvalidArgument(f"key name {name!r}: use 1-64 letters, digits, '_', '.', '-'")
    os.makedirs(directory, exist_ok=True)
    pub, sec = os.path.join(directory, name + ".key"), os.path.join(directory, name + ".key_secret")
    for f in (pub, sec):
        if os.path.exists(f):
            raise InvalidArgument(f"{f} exists already; not overwritten")
    old = os.umask(0o077)
    try:
        zmq.auth.create_certificates(directory, name)
    finally:
        os.umask(old)
    os.chmod(sec, 0o600)
    os.chmod(pub, 0o644)
    return pub, sec


@dataclass(frozen=True, slots=True)
class ServerKeys:
    """A server's CURVE identity and the client keys it lets in."""

    public: bytes
    secret: bytes
    allowed: frozenset[bytes]

    @classmethod
    def load(cls, secret_file: str, allowed: str) -> ServerKeys:
        public, secret = load_secret(secret_file, "server secret key")
        return cls(public, secret, load_allowed(allowed))

    def apply(self, sock: zmq.Socket) -> None:
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret)
        sock.setsockopt(zmq.ZAP_DOMAIN, b"tensorhub")


@dataclass(frozen=True, slots=True)
class ClientKeys:
    """A client's CURVE key pair and the server's public key."""

    public: bytes
    secret: bytes
    server: bytes

    def apply(self, sock: zmq.Socket) -> None:
        sock.setsockopt(zmq.CURVE_SERVERKEY, self.server)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret)


def client_keys(server_key: str | None = None, secret: str | None = None) -> ClientKeys | None:
    """The client's CURVE keys from the arguments, else ``$TENSORHUB_CURVE_SERVER_KEY`` and
    ``$TENSORHUB_CURVE_SECRET``; None when neither is set (plain connections).

    Raises:
        InvalidArgument: only one of the two is set, or one cannot be read (named).
    """
    server_key = server_key or os.environ.get(ENV_SERVER_KEY) or None
    secret = secret or os.environ.get(ENV_SECRET) or None
    if server_key is None and secret is None:
        return None
    if server_key is None or secret is None:
        missing = ENV_SERVER_KEY if server_key is None else ENV_SECRET
        raise InvalidArgument(f"CURVE needs both the server's public key and this client's secret key; {missing} is not set")
    public, sec = load_secret(secret, f"client secret key (${ENV_SECRET})")
    return ClientKeys(public, sec, load_public(server_key, f"server public key (${ENV_SERVER_KEY})"))


def apply_client(sock: zmq.Socket, keys: ClientKeys | None) -> None:
    """Configure a DEALER for CURVE before it connects (nothing when ``keys`` is None)."""
    if keys is not None:
        keys.apply(sock)


_HOST = re.compile(r"^tcp://(\[[^\]]*\]|[^:/]*)(?::[^/]*)?$")


def is_loopback(address: str) -> bool:
    """Whether a ZeroMQ bind address reaches this machine only (``ipc://``, ``inproc://``, or
    ``tcp://`` on a loopback address or ``localhost``). ``*``, ``0.0.0.0``, interface names and
    other addresses are not."""
    if address.startswith(("ipc://", "inproc://")):
        return True
    match = _HOST.match(address)
    if not match:
        return False
    host = match.group(1).strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(address: str, keys: ServerKeys | None, insecure: bool) -> None:
    """Refuse a non-loopback bind without CURVE keys, unless ``insecure``.

    Raises:
        InvalidArgument: naming the address and the two ways out.
    """
    if keys is None and not insecure and not is_loopback(address):
        raise InvalidArgument(
            f"refusing to bind {address} without authentication: it is not a loopback address. "
            "Give the server CURVE keys (--curve-secret and --curve-clients; see tensorhub keygen), "
            "or pass --insecure to serve unauthenticated clients on this network"
        )


class KeyAuthenticator:
    """A ZAP handler for one context: lets in CURVE clients whose public key is allowed.

    Counts what it refuses (``denied``: by reason) and names each accepted connection by its
    Z85 public key (the ``User-Id`` of the messages that arrive on it).
    """

    ZAP_ENDPOINT = "inproc://zeromq.zap.01"

    def __init__(self, ctx: zmq.asyncio.Context, allowed: frozenset[bytes]) -> None:
        self.ctx = ctx
        self.allowed = allowed
        self.accepted = 0
        self.denied: dict[str, int] = {}
        self._sock: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        sock = self.ctx.socket(zmq.REP)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(self.ZAP_ENDPOINT)
        self._sock = sock
        self._task = asyncio.ensure_future(self._serve())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - stopping
                pass
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None

    def decide(self, frames: list[bytes]) -> tuple[bytes, bytes, bytes, bytes]:
        """(request id, status code, status text, user id) for one ZAP request."""
        if len(frames) < 6:
            self._deny("malformed ZAP request")
            return (frames[1] if len(frames) > 1 else b"", b"400", b"malformed request", b"")
        version, request_id, _domain, _address, _identity, mechanism = frames[:6]
        credentials = frames[6:]
        if version != b"1.0":
            self._deny("ZAP version")
            return request_id, b"400", b"unsupported ZAP version", b""
        if mechanism != b"CURVE" or len(credentials) != 1 or len(credentials[0]) != 32:
            self._deny("not CURVE")
            return request_id, b"400", b"CURVE required", b""
        key = zmq.utils.z85.encode(credentials[0])
        if key not in self.allowed:
            self._deny("key not allowed")
            return request_id, b"400", b"key not allowed", b""
        self.accepted += 1
        return request_id, b"200", b"OK", key

    def _deny(self, reason: str) -> None:
        self.denied[reason] = self.denied.get(reason, 0) + 1

    async def _serve(self) -> None:
        assert self._sock is not None
        while True:
            frames = await self._sock.recv_multipart()
            request_id, code, text, user = self.decide(frames)
            await self._sock.send_multipart([b"1.0", request_id, code, text, user, b""])


def user_id(frame: Any) -> str | None:
    """The authenticated key of the connection a received frame came on (None without CURVE)."""
    try:
        uid = frame.get("User-Id")
    except (zmq.ZMQError, AttributeError, UnicodeDecodeError):
        return None
    return uid or None


RIGHTS = ("publish", "read")


@dataclass(frozen=True, slots=True)
class _Rule:
    patterns: tuple[str, ...]
    publish: frozenset[str]  # Z85 keys, or "*"
    read: frozenset[str]


@dataclass(frozen=True, slots=True)
class ModelPolicy:
    """Which client keys may publish and read which models (see the module docstring).

    Build it with :meth:`load` (a file) or :meth:`parse` (its text); ask it with :meth:`allows`.
    """

    rules: tuple[_Rule, ...]

    @classmethod
    def load(cls, path: str, clients: str) -> ModelPolicy:
        """Read the policy file ``path``; key names resolve against ``clients`` (the directory or
        file of ``--curve-clients``).

        Raises:
            InvalidArgument: unreadable, not TOML, or a rule that is not valid (named).
        """
        try:
            text = Path(path).read_text()
        except (OSError, UnicodeDecodeError) as err:
            raise InvalidArgument(f"model policy: cannot read {path!r}: {err}") from None
        return cls.parse(text, _key_names(clients), where=path)

    @classmethod
    def parse(cls, text: str, names: dict[str, str], where: str = "the model policy") -> ModelPolicy:
        """The policy in TOML ``text``; ``names``: key name -> Z85 public key.

        Raises:
            InvalidArgument: the text is not a valid policy (what and where named).
        """
        import fnmatch
        import tomllib

        try:
            doc = tomllib.loads(text)
        except tomllib.TOMLDecodeError as err:
            raise InvalidArgument(f"model policy {where}: not TOML: {err}") from None
        unknown = set(doc) - {"rule"}
        if unknown:
            raise InvalidArgument(f"model policy {where}: unknown top-level keys {sorted(unknown)}; only [[rule]] tables")
        raw = doc.get("rule", [])
        if not isinstance(raw, list) or not raw:
            raise InvalidArgument(f"model policy {where}: no [[rule]] table")
        rules = []
        for i, r in enumerate(raw, 1):
            what = f"model policy {where}, rule {i}"
            if not isinstance(r, dict) or set(r) - {"models", "publish", "read"} or "models" not in r:
                raise InvalidArgument(f"{what}: a rule has 'models' and optionally 'publish' and 'read', nothing else")
            models = [r["models"]] if isinstance(r["models"], str) else r["models"]
            if not isinstance(models, list) or not models or not all(isinstance(p, str) and p for p in models):
                raise InvalidArgument(f"{what}: 'models' is a pattern or a list of patterns (fnmatch)")
            for pat in models:
                fnmatch.translate(pat)
            keys = {}
            for right in RIGHTS:
                given = r.get(right, [])
                if isinstance(given, str):
                    given = [given]
                if not isinstance(given, list) or not all(isinstance(k, str) for k in given):
                    raise InvalidArgument(f"{what}: {right!r} is a list of key names (or \"*\")")
                resolved = set()
                for k in given:
                    if k == "*":
                        resolved.add("*")
                    elif k in names:
                        resolved.add(names[k])
                    elif _Z85_KEY.match(k.encode()):
                        resolved.add(k)
                    else:
                        raise InvalidArgument(f"{what}: {right} names {k!r}, which is no allowed client key's name nor a Z85 key")
                keys[right] = frozenset(resolved)
            rules.append(_Rule(tuple(models), keys["publish"], keys["publish"] | keys["read"]))
        return cls(tuple(rules))

    def allows(self, key: str, model: str, right: str) -> bool:
        """Whether ``key`` (a connection's Z85 public key) may ``right`` (``publish`` or
        ``read``) ``model``. The first rule whose pattern matches decides; none: refused."""
        import fnmatch

        from tensorhub.core.naming import delta_owner

        name = delta_owner(model) or model
        for rule in self.rules:
            if any(fnmatch.fnmatchcase(name, p) for p in rule.patterns):
                keys = rule.publish if right == "publish" else rule.read
                return "*" in keys or key in keys
        return False


def _key_names(clients: str) -> dict[str, str]:
    """Key name -> Z85 public key, for every ``*.key`` file of ``--curve-clients``."""
    p = Path(clients)
    files = sorted(f for f in p.iterdir() if f.suffix == ".key" and f.is_file()) if p.is_dir() else [p]
    return {f.stem: _read_cert(f, "allowed client key")[0].decode() for f in files}
