"""Prometheus metrics: counters, gauges and histograms in the text exposition format (0.0.4),
and a small HTTP endpoint that serves them (``tensorhub server --metrics-port``).

Written by hand (the format is a few lines of text per sample) so that the server needs no
client library. A :class:`Registry` holds the families the server updates as it goes (frames,
requests, latency, transfer durations reported by clients) and *collectors*: callables run at
scrape time that produce families from the state (holders, grants, the table's counters).

The HTTP side answers ``GET /metrics`` (and ``/``) and nothing else; requests are bounded in
size and time, and a scrape never blocks the server's event loop for longer than rendering.
"""

from __future__ import annotations

import asyncio
import bisect
import math
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

__all__ = ["DURATION_BUCKETS", "LATENCY_BUCKETS", "Counter", "Gauge", "Histogram", "MetricsServer", "Registry", "parse_text"]

LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
DURATION_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)

_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_MAX_SERIES = 10_000  # label sets per family: a bound on what hostile label values could grow


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(names: Sequence[str], values: Sequence[str], extra: str = "") -> str:
    parts = [f'{n}="{_escape(str(v))}"' for n, v in zip(names, values)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _num(v: float) -> str:
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    if math.isnan(v):
        return "NaN"
    return repr(int(v)) if float(v).is_integer() and abs(v) < 1 << 53 else repr(float(v))


class _Family:
    kind = ""

    def __init__(self, name: str, help: str, labels: Sequence[str] = ()) -> None:
        if not _NAME.match(name):
            raise ValueError(f"bad metric name {name!r}")
        self.name = name
        self.help = help
        self.labelnames = tuple(labels)
        self.series: dict[tuple[str, ...], Any] = {}

    def _key(self, labels: Sequence[str]) -> tuple[str, ...] | None:
        key = tuple(str(x) for x in labels)
        if len(key) != len(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}, got {key}")
        if key not in self.series and len(self.series) >= _MAX_SERIES:
            return None  # full: drop rather than grow without bound
        return key

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]

    def render(self) -> list[str]:
        raise NotImplementedError


class Counter(_Family):
    """A monotonically increasing count, per label set."""

    kind = "counter"

    def inc(self, *labels: str, by: float = 1.0) -> None:
        series = self.series
        if labels in series:  # the common case: a label set seen before (str labels)
            series[labels] += by
            return
        key = self._key(labels)
        if key is not None:
            self.series[key] = self.series.get(key, 0.0) + by

    def set(self, *labels: str, value: float) -> None:
        """Set the total (for counters kept elsewhere, e.g. the table's own counts)."""
        key = self._key(labels)
        if key is not None:
            self.series[key] = value

    def value(self, *labels: str) -> float:
        return self.series.get(tuple(str(x) for x in labels), 0.0)

    def render(self) -> list[str]:
        series = self.series if self.series or self.labelnames else {(): 0.0}
        return self.header() + [f"{self.name}{_labels(self.labelnames, k)} {_num(v)}" for k, v in sorted(series.items())]


class Gauge(Counter):
    """A value that goes up and down, per label set."""

    kind = "gauge"


class Histogram(_Family):
    """Observations counted into cumulative buckets, with their sum and count."""

    kind = "histogram"

    def __init__(self, name: str, help: str, labels: Sequence[str] = (), buckets: Sequence[float] = LATENCY_BUCKETS) -> None:
        super().__init__(name, help, labels)
        self.buckets = tuple(sorted(buckets))

    def observe(self, value: float, *labels: str) -> None:
        s = self.series.get(labels)  # the common case: a label set seen before (str labels)
        if s is None:
            key = self._key(labels)
            if key is None:
                return
            s = self.series.get(key)
            if s is None:
                s = self.series[key] = [[0] * len(self.buckets), 0.0, 0]
        i = bisect.bisect_left(self.buckets, value)
        if i < len(self.buckets):
            s[0][i] += 1
        s[1] += value
        s[2] += 1

    def count(self, *labels: str) -> int:
        s = self.series.get(tuple(str(x) for x in labels))
        return s[2] if s else 0

    def render(self) -> list[str]:
        out = self.header()
        for key, (counts, total, n) in sorted(self.series.items()):
            acc = 0
            for bound, c in zip(self.buckets, counts):
                acc += c
                le = 'le="' + _num(bound) + '"'
                out.append(f"{self.name}_bucket{_labels(self.labelnames, key, le)} {acc}")
            inf = 'le="+Inf"'
            out.append(f"{self.name}_bucket{_labels(self.labelnames, key, inf)} {n}")
            out.append(f"{self.name}_sum{_labels(self.labelnames, key)} {_num(total)}")
            out.append(f"{self.name}_count{_labels(self.labelnames, key)} {n}")
        return out


class Registry:
    """The families a process exposes, plus collectors run at each scrape."""

    def __init__(self) -> None:
        self.families: dict[str, _Family] = {}
        self.collectors: list[Callable[[], Iterable[_Family]]] = []

    def add(self, family: _Family) -> Any:
        if family.name in self.families:
            raise ValueError(f"metric {family.name} registered twice")
        self.families[family.name] = family
        return family

    def counter(self, name: str, help: str, labels: Sequence[str] = ()) -> Counter:
        return self.add(Counter(name, help, labels))

    def gauge(self, name: str, help: str, labels: Sequence[str] = ()) -> Gauge:
        return self.add(Gauge(name, help, labels))

    def histogram(self, name: str, help: str, labels: Sequence[str] = (), buckets: Sequence[float] = LATENCY_BUCKETS) -> Histogram:
        return self.add(Histogram(name, help, labels, buckets))

    def render(self) -> str:
        """The whole exposition, families sorted by name."""
        fams = dict(self.families)
        for collect in self.collectors:
            for f in collect():
                fams[f.name] = f
        lines: list[str] = []
        for name in sorted(fams):
            lines.extend(fams[name].render())
        return "\n".join(lines) + "\n"


_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? (\S+)$')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_text(text: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """Parse an exposition back into ``{sample name: {sorted label pairs: value}}`` (for tests
    and the fuzz benchmark), refusing any line that is not a comment or a valid sample.

    Raises:
        ValueError: a malformed line (quoted).
    """
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    types: dict[str, str] = {}
    for line in text.splitlines():
        if not line:
            continue
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            if kind not in ("counter", "gauge", "histogram", "summary", "untyped"):
                raise ValueError(f"bad TYPE line: {line!r}")
            types[name] = kind
            continue
        if line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            raise ValueError(f"not a sample line: {line!r}")
        name, _, body, value = m.groups()
        labels: list[tuple[str, str]] = []
        if body:
            consumed = ",".join(f'{k}="{v}"' for k, v in _LABEL.findall(body))
            if consumed != body:
                raise ValueError(f"bad labels: {line!r}")
            labels = [(k, v.replace('\\"', '"').replace("\\n", "\n").replace("\\\\", "\\")) for k, v in _LABEL.findall(body)]
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        if name not in types and base not in types:
            raise ValueError(f"sample without a TYPE line: {line!r}")
        out.setdefault(name, {})[tuple(sorted(labels))] = float(value)
    return out


class MetricsServer:
    """``GET /metrics`` over HTTP/1.0 on ``host:port`` (port 0: any free port)."""

    MAX_REQUEST = 8192
    TIMEOUT = 5.0

    def __init__(self, registry: Registry, host: str, port: int) -> None:
        self.registry = registry
        self.host = host
        self.port = port
        self.scrapes = 0
        self._server: asyncio.base_events.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, self.host, self.port, limit=self.MAX_REQUEST)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.TIMEOUT)
            request = head.split(b"\r\n", 1)[0].split(b" ")
            if len(request) != 3 or request[0] != b"GET":
                status, body, ctype = b"405 Method Not Allowed", b"only GET /metrics\n", b"text/plain"
            elif request[1].split(b"?")[0] not in (b"/metrics", b"/"):
                status, body, ctype = b"404 Not Found", b"try /metrics\n", b"text/plain"
            else:
                self.scrapes += 1
                status, body = b"200 OK", self.registry.render().encode()
                ctype = b"text/plain; version=0.0.4; charset=utf-8"
            writer.write(b"HTTP/1.0 " + status + b"\r\nContent-Type: " + ctype
                         + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)  # fmt: skip
            await asyncio.wait_for(writer.drain(), self.TIMEOUT)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError, ValueError):
            pass  # a bad or slow scraper gets nothing
        finally:
            writer.close()
            try:
                await writer.wait_closed()
            except (ConnectionError, OSError):
                pass


def scrape(host: str, port: int, timeout: float = 5.0) -> str:
    """Fetch ``/metrics`` (blocking; for tests, the CLI and benchmarks).

    Raises:
        OSError: no connection, or not a 200 answer.
    """
    import urllib.request

    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=timeout) as resp:
        return resp.read().decode()
