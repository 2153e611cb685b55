"""Replicate-then-flip against update-in-place, in one run: the pause an engine sees per version.

Workload: ``--versions`` versions of ``--layers`` float32 matrices of ``--hidden``² published by
a trainer process, taken by two rollout engines generating in this process.
Baseline: ``update("latest")`` at a request boundary (update in place), in the same run.
Goal: the flip's switch pause <= 1/10 of the update's (medians).

A trainer process publishes versions of a model (``--layers`` float32 matrices of
``--hidden``², 256 MiB by default). Two rollout "engines" in this process generate without end
(each request: a few steps of ``x @ W`` through every layer, with ``nn.Parameter`` weights), and
between requests (the request boundary) take new versions:

- ``update``: ``h.update("latest")`` at each boundary; the call that moves pulls the whole
  version while generation waits;
- ``flip``: ``h.prefetch("latest")`` at each boundary while nothing is pending (it returns at
  once; the pull runs in the background while the engine keeps generating from the active
  set), and once ``h.prefetched`` says the shadow set holds it, ``h.flip()`` swaps the sets and
  the parameters are re-pointed (``p.data = h.tensors[name]``: no copy).

For each version: the *switch pause* (the boundary call that moved or flipped, re-pointing
included), the other boundary calls' time until the version served, the requests served while it
arrived, and the time from publish to serving it. Each engine checks the weights it serves after
every switch. Printed at the end: the median switch pause of each mode and their ratio (goal:
flip <= 1/10 of update), and what the shadow set costs in memory.

    python benchmarks/bench_flip.py [--versions 5] [--layers 16] [--hidden 2048] [--transports tcp]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import tensorhub  # noqa: E402
from benchmarks.harness import BenchmarkError, Child, median, start_server, stop_process  # noqa: E402

MODEL = "bench-flip"


def _weights(layers: int, hidden: int) -> dict[str, torch.Tensor]:
    out = {f"layers.{i}.weight": torch.zeros(hidden, hidden) for i in range(layers)}
    out["norm.weight"] = torch.zeros(hidden)  # a tiny one too: it goes through a pack
    return out


def _trainer(conn: Any, address: str, layers: int, hidden: int, transports: dict) -> None:
    try:
        h = tensorhub.open(MODEL, "trainer", server=address, transports=transports)
        w = _weights(layers, hidden)
        h.register(w)
        conn.send(("ready",))
        for _ in range(10_000):
            msg = conn.recv()
            if msg[0] == "quit":
                break
            v = msg[1]
            if h.version is not None:
                h.unpublish()
            for t in w.values():
                t.fill_(v / 1000)
            h.publish(v)
            conn.send(("published", v, time.perf_counter()))
        h.close()
    except BaseException:  # noqa: BLE001 - reported to the parent
        conn.send(("error", traceback.format_exc()))


class Engine:
    """A toy decoder whose parameters are the handle's active tensors."""

    def __init__(self, replica: str, mode: str, address: str, layers: int, hidden: int, transports: dict) -> None:
        self.mode = mode
        self.h = tensorhub.open(MODEL, replica, server=address, transports=transports)
        self.h.register(_weights(layers, hidden))
        self.shadow_bytes = self.h.register_shadow() if mode == "flip" else 0
        self.module = torch.nn.Module()
        self.params = {n: torch.nn.Parameter(t, requires_grad=False) for n, t in self.h.tensors.items()}
        for n, p in self.params.items():
            self.module.register_parameter(n.replace(".", "_"), p)
        self.x = torch.randn(8, hidden)
        self.requests = 0

    def repoint(self) -> None:
        for n, t in self.h.tensors.items():
            self.params[n].data = t

    def request(self, steps: int = 2) -> None:
        x = self.x
        with torch.no_grad():
            for _ in range(steps):
                for n, p in self.params.items():
                    if p.dim() == 2:
                        x = torch.tanh(x @ p)
        self.requests += 1

    def check(self, v: int) -> None:
        for n, p in self.params.items():
            if p.reshape(-1)[0].item() != torch.tensor(v / 1000, dtype=p.dtype).item():
                raise BenchmarkError(f"{self.mode}: {n} does not hold version {v} after the switch")

    def boundary(self) -> tuple[bool, float]:
        """Take what arrived, at a request boundary: (switched, seconds the call took)."""
        t0 = time.perf_counter()
        if self.mode == "update":
            moved = self.h.update("latest")
        elif self.h.prefetched is not None:
            moved = self.h.flip()
            if moved:
                self.repoint()
        else:
            self.h.prefetch("latest")
            moved = False
        return moved, time.perf_counter() - t0

    def serve_until(self, v: int, published_at: float, timeout: float = 300.0) -> dict:
        """Generate until version ``v`` serves: what the engine saw meanwhile."""
        other, requests0 = 0.0, self.requests
        deadline = time.monotonic() + timeout
        while self.h.version != v:
            if time.monotonic() > deadline:
                raise BenchmarkError(f"{self.mode}: version {v} did not arrive in {timeout:g} s")
            self.request()
            moved, took = self.boundary()
            if moved:
                pause = took
            else:
                other += took
        self.check(v)
        return {"version": v, "switch_pause_s": pause, "other_boundary_s": other,
                "requests_meanwhile": self.requests - requests0, "publish_to_serving_s": time.perf_counter() - published_at}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--versions", type=int, default=5)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--transports", default="tcp", help="comma-separated transports (default tcp)")
    ap.add_argument("--json", type=Path, help="write the results here too")
    args = ap.parse_args(argv)
    transports = {n: {} for n in args.transports.split(",") if n}
    torch.manual_seed(0)
    model_bytes = sum(t.nbytes for t in _weights(args.layers, args.hidden).values())
    print(f"model: {args.layers} x {args.hidden}^2 float32 = {model_bytes / 2**20:.0f} MiB; transports {sorted(transports)}")
    server, address = start_server(30)
    trainer = None
    engines: dict[str, Engine] = {}
    try:
        trainer = Child("trainer", _trainer, (address, args.layers, args.hidden, transports), timeout=120)
        trainer.expect("ready")
        trainer.send("publish", 1)
        trainer.expect("published")
        engines["update"] = Engine("rollout-update", "update", address, args.layers, args.hidden, transports)
        engines["flip"] = Engine("rollout-flip", "flip", address, args.layers, args.hidden, transports)
        for e in engines.values():
            e.h.replicate(1)
            e.repoint()
            e.check(1)
        rows: dict[str, list[dict]] = {"update": [], "flip": []}
        for v in range(2, args.versions + 2):
            trainer.send("publish", v)
            _, _, at = trainer.expect("published")
            for mode in ("update", "flip") if v % 2 else ("flip", "update"):  # neither always goes first
                row = engines[mode].serve_until(v, at)
                rows[mode].append(row)
                print(f"v{v} {mode:>6}: switch pause {row['switch_pause_s'] * 1e3:8.2f} ms, other boundary calls "
                      f"{row['other_boundary_s'] * 1e3:7.2f} ms, {row['requests_meanwhile']:3d} requests served while it "
                      f"arrived, publish -> serving {row['publish_to_serving_s']:.2f} s")  # fmt: skip
        med = {mode: median(r["switch_pause_s"] for r in rs) for mode, rs in rows.items()}
        ratio = med["flip"] / med["update"] if med["update"] else float("inf")
        shadow = engines["flip"].shadow_bytes
        print(f"median switch pause: update {med['update'] * 1e3:.2f} ms, flip {med['flip'] * 1e3:.2f} ms: "
              f"flip/update = {ratio:.4f} (goal <= 0.1: {'met' if ratio <= 0.1 else 'MISSED'})")  # fmt: skip
        print(f"memory: the shadow set costs {shadow / 2**20:.1f} MiB ({shadow / model_bytes:.3f} x the model) on top of "
              f"the active set; the update engine holds one copy ({model_bytes / 2**20:.0f} MiB), the flip engine two")  # fmt: skip
        if args.json:
            args.json.write_text(json.dumps({"rows": rows, "median_switch_pause_s": med, "ratio": ratio,
                                             "shadow_bytes": shadow, "model_bytes": model_bytes}, indent=1))  # fmt: skip
        return 0 if ratio <= 0.1 else 1
    finally:
        for e in engines.values():
            e.h.close()
        if trainer is not None:
            trainer.stop()
        stop_process(server)


if __name__ == "__main__":
    sys.exit(main())
