"""``tensorhub demo``: an RL-shaped job on one machine, on the embedded default server.

A trainer replica of ``--shards`` processes trains a small transformer on a task it can learn in
a few steps: predict the next token of sequences that count up by one modulo 64 from a random
start (Adam, fixed seeds; the loss falls from about 6.5 to near 0 over the default 8 steps). It publishes every step (each shard holds every ``--shards``-th parameter tensor, as a
stand-in for tensor parallelism: the shards train identical copies, so their halves agree).
``--rollouts`` rollout replicas of ``--shards`` processes each loop ``update("latest")`` between
"inference" batches. The trainer starts once every rollout shard is up, and runs at most
``MAX_STALENESS`` versions ahead of the slowest rollout (a rollout restarting after a SIGKILL is
not waited for; after waiting ``GATE_WAIT`` s at once it stops waiting, and the staleness check
names who lagged), as an RL trainer bounds how stale the weights its rollouts generate with may
be. Each ``update`` is bounded (``UPDATE_TIMEOUT``; one that runs out counts as aborted). The shards of each replica make their calls together,
as the ranks of a tensor-parallel engine do (a barrier stands in for their collectives).

For each step the parent shows each rollout's *staleness*: the trainer's newest published version
minus the version the rollout holds, the most it reached while that step was the newest (1: the
rollout held the previous version when this one came out, and pulled it; 2: it was a version
further behind). Live, with ``rich`` when it is importable and stdout is a terminal; as plain
lines otherwise (all at the end with ``--quiet``). Then a summary: the loss first -> last, bytes
moved, stall time, aborted updates, empty handles and maximum staleness per rollout, the server's
pin and re-decision counters over the run, who served whom.

The demo checks what the README promises and exits 1 naming each check that failed:

- every rollout shard ends with the trainer's final weights, byte for byte (a digest);
- the loss fell: the final weights' loss on a fresh batch is below the first step's loss;
- no update (or first replicate) aborted, and no rollout found its handle empty after one;
- no rollout lagged the trainer by more than ``MAX_STALENESS`` versions at any step.

With ``--chaos`` a seeded schedule (``--seed``) SIGKILLs a whole rollout replica (all its shard
processes, once each has opened its handle and registered) every one to three seconds while
training runs, but not twice before the trainer has published a new version (on a loaded
machine kills on the clock alone can leave no window for a step), and restarts it under the
same name:
the new incarnation fences the old one on the server, pulls the latest version, and carries on.
Readers that were pulling from a killed replica are re-granted elsewhere. A killed replica is
exempt from the last two checks (its restart starts empty, far behind); the others are held to
them, and every replica to the byte-for-byte check. The summary counts the kills.
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing
import multiprocessing.connection
import os
import random
import signal
import sys
import time
from collections import defaultdict
from typing import Any

__all__ = ["run_demo"]

MODEL = "demo-policy"
VOCAB = 512
#: the training sequences count up by one modulo this
PERIOD = 64
#: the model's initialization seed and the training data's seed
INIT_SEED = 0
DATA_SEED = 1234
LEARNING_RATE = 1e-3
#: no rollout that was not SIGKILLed may be further behind the trainer than this, at any step
MAX_STALENESS = 2
#: the longest the trainer waits for rollouts to come within MAX_STALENESS; past it, it stops
#: waiting for the rest of the run (and the staleness check names who lagged)
GATE_WAIT = 20.0
#: the longest one update() of a rollout may take (then it counts as aborted, and is named)
UPDATE_TIMEOUT = 30.0


def _build_model(width: int, layers: int, vocab: int = VOCAB) -> Any:
    import torch
    from torch import nn

    class Policy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, width)
            layer = nn.TransformerEncoderLayer(width, nhead=8, dim_feedforward=4 * width, batch_first=True, dropout=0.0)
            self.body = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.head = nn.Linear(width, vocab)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.head(self.body(self.embed(tokens)))

    torch.manual_seed(INIT_SEED)
    return Policy()


def _batch(gen: Any, rows: int = 8, length: int = 64) -> Any:
    """Sequences that count up by one modulo ``PERIOD`` from a random start (the next token is
    the last one plus one): a pattern the small model learns in a few steps."""
    import torch

    start = torch.randint(0, PERIOD, (rows, 1), generator=gen)
    return (start + torch.arange(length)) % PERIOD


def _loss(model: Any, tokens: Any) -> Any:
    import torch

    return torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())


def _owned(model: Any, shard: int, shards: int) -> dict[str, Any]:
    """The parameter tensors shard ``shard`` holds (every ``shards``-th, in a fixed order)."""
    return {name: p.data for i, (name, p) in enumerate(sorted(model.named_parameters())) if i % shards == shard}


def _digest(tensors: dict[str, Any]) -> str:
    import torch

    h = hashlib.sha256()
    for name, t in tensors.items():
        h.update(name.encode())
        h.update(t.detach().contiguous().view(-1).view(dtype=torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


# ---- the worker processes ----------------------------------------------------------------------


class _Events:
    """The workers' events, each worker on a pipe of its own to this process. One queue shared
    by all of them broke under chaos: a worker SIGKILLed while its queue's feeder thread held
    the queue's write lock left every other worker's events stuck behind that lock, and the run
    timed out "with the trainer at v0" while the workers were still working. A killed worker
    now takes only its own pipe with it."""

    SLOT = object()  #: stands for the worker's own pipe in a target's arguments

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx
        self.readers: list[Any] = []
        self._writers: dict[Any, Any] = {}  # process -> the writing end, closed here once it started
        self._ready: list[Any] = []

    def process(self, target: Any, args: tuple, name: str) -> Any:
        reader, writer = self.ctx.Pipe(duplex=False)
        proc = self.ctx.Process(target=target, args=tuple(writer if x is self.SLOT else x for x in args), name=name)
        self.readers.append(reader)
        self._writers[proc] = writer
        return proc

    def start(self, proc: Any) -> None:
        proc.start()
        self._writers.pop(proc).close()  # the worker holds it now: its end (or death) is seen as EOF

    def get(self, timeout: float) -> Any:
        """The next event from any worker; TimeoutError when none came within ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            if not self._ready:
                self._ready = list(multiprocessing.connection.wait(self.readers, max(0.0, deadline - time.monotonic())))
                if not self._ready:
                    raise TimeoutError("no event")
            conn = self._ready.pop()
            try:
                return conn.recv()
            except (EOFError, OSError):
                # the worker is gone (exited, or SIGKILLed): its pipe is done. (An event is one
                # small write, under the pipe's atomic size: a kill cannot cut one in half.)
                self.readers.remove(conn)
                conn.close()


def _trainer(shard: int, a: dict, events: Any, sync: dict[str, Any]) -> None:
    """``sync``: ``go`` (every rollout is up), ``together`` (a barrier of the trainer's shards),
    ``allowed`` (the newest version it may publish now) and ``finish`` (every rollout is done)."""
    import torch

    import tensorhub

    torch.set_num_threads(1)
    model = _build_model(a["width"], a["layers"])
    # Adam updates the parameters in place: the registered tensors are the parameters' storage.
    opt = torch.optim.Adam(model.parameters(), lr=LEARNING_RATE)
    tensors = _owned(model, shard, a["shards"])
    with tensorhub.open(MODEL, "trainer", num_shards=a["shards"], shard_idx=shard, server=a["server"]) as h:
        h.register(tensors)
        sync["go"].wait(a["timeout"])  # every rollout is up (or the run is over)
        gen = torch.Generator().manual_seed(DATA_SEED)
        gated = True
        for step in range(1, a["steps"] + 1):
            loss = _loss(model, _batch(gen))
            opt.zero_grad()
            loss.backward()
            # Bounded staleness: no more than MAX_STALENESS versions ahead of a rollout (an RL
            # trainer bounds how old the weights of the rollouts it learns from may be).
            t0 = time.monotonic()
            while gated and sync["allowed"].value < step:
                if time.monotonic() - t0 > GATE_WAIT:
                    gated = False  # a rollout is stuck: stop waiting (the staleness check will say so)
                time.sleep(0.005)
            waited = time.monotonic() - t0
            sync["together"].wait(a["timeout"])  # the shards step together (tensor-parallel ranks all-reduce here)
            t0 = time.monotonic()
            if step > 1:
                h.unpublish()  # readers of the last step drain (or it is offloaded) before we write
            stall = time.monotonic() - t0
            opt.step()  # mutates the registered tensors in place
            h.publish(step)
            events.send(("train", shard, step, loss.item(), stall, waited))
        with torch.no_grad():  # the final weights' loss, on a batch no step trained on
            events.send(("eval", shard, _loss(model, _batch(gen)).item()))
        events.send(("final", "trainer", 0, shard, a["steps"], _digest(tensors)))
        sync["finish"].wait(a["timeout"])  # keep serving until every rollout has the last version


def _rollout(replica: str, incarnation: int, shard: int, a: dict, events: Any, together: Any) -> None:
    import threading

    import torch

    import tensorhub
    from tensorhub.core.errors import Timeout, TransportError, UpdateAborted, VersionUnavailable

    me = (replica, incarnation, shard)
    torch.set_num_threads(1)
    model = _build_model(a["width"], a["layers"])
    tensors = _owned(model, shard, a["shards"])
    for t in tensors.values():
        t.zero_()  # nothing is known until the first version arrives
    deadline = time.monotonic() + a["timeout"]
    with tensorhub.open(MODEL, replica, num_shards=a["shards"], shard_idx=shard, server=a["server"]) as h:
        h.register(tensors)
        events.send(("ready", *me))
        for _ in range(100):
            try:
                h.replicate("latest", timeout=a["timeout"])
                break
            except (VersionUnavailable, TransportError) as err:
                # The version it decided went away mid-pull, or chaos killed every source it
                # was granted (a restarted rollout's first pull may come from the other one).
                events.send(("aborted", *me, f"replicate: {type(err).__name__}: {err}"))
                if h.empty:
                    events.send(("empty", *me))
        if not h.empty:
            events.send(("pulled", *me, h.version, 0.0, h.last_pull.bytes, list(h.last_pull.sources)))
        in_step = True  # with the replica's other shards (see below)
        while (h.version or 0) < a["steps"] and time.monotonic() < deadline:
            if in_step:
                # The shards of a replica make the same calls in the same order, together, as an
                # inference engine's ranks do: the n-th update of each shard is one replica-wide
                # update. (A shard that ran ahead would wait in its update for the others.)
                try:
                    together.wait(max(0.0, deadline - time.monotonic()))
                except threading.BrokenBarrierError:
                    in_step = False  # a sibling is done (or gone): carry on alone
            t0 = time.monotonic()
            try:
                moved = h.update("latest", timeout=min(UPDATE_TIMEOUT, max(1.0, deadline - time.monotonic())))
            except (UpdateAborted, Timeout) as err:
                # A real failure (every source died, or it took too long): the handle may be
                # empty; the next update takes the newest version.
                events.send(("aborted", *me, f"{type(err).__name__}: {err}"))
                moved = False
            if h.empty:
                events.send(("empty", *me))
                time.sleep(0.02)
                continue
            stall = time.monotonic() - t0
            if moved:
                p = h.last_pull
                events.send(("pulled", *me, h.version, stall, p.bytes, list(p.sources)))
            with torch.no_grad():  # an "inference" batch on the weights this shard holds
                for t in list(tensors.values())[:8]:
                    if t.dim() == 2:
                        torch.mm(t, t.t()[:, :64])
            time.sleep(0.02)
        together.abort()  # release a sibling still waiting: this shard makes no more calls
        events.send(("final", *me, h.version, _digest(tensors)))


# ---- what the parent knows (no IO) ---------------------------------------------------------------


class _Progress:
    """The run as the workers' events tell it: published versions, what each rollout shard holds,
    staleness per step, the loss, pulls, aborts. Events from a rollout incarnation that was
    SIGKILLed since are ignored (it is gone; its successor reports afresh)."""

    def __init__(self, steps: int, shards: int, rollouts: list[str]) -> None:
        self.steps, self.shards, self.rollouts = steps, shards, rollouts
        self.published: dict[int, int] = {}  # trainer shard -> newest step it published
        self.losses: dict[int, float] = {}  # step -> the loss it trained on (shard 0's)
        self.final_loss: float | None = None  # the final weights' loss on a fresh batch
        self.trainer_stall = 0.0
        self.trainer_waited = 0.0  # for rollouts to come within MAX_STALENESS
        self.incarnation = dict.fromkeys(rollouts, 0)
        self.ready: set[tuple[str, int]] = set()
        self.held: dict[tuple[str, int], int] = {}  # (rollout, shard) -> version held (0: none)
        self.lag: dict[int, dict[str, int]] = defaultdict(dict)  # step -> rollout -> most versions behind
        self.restarting: dict[int, set[str]] = defaultdict(set)  # step -> rollouts killed or restarting in it
        self.recovering: set[str] = set()  # killed, and not yet holding a version on every shard
        self.killed: list[tuple[float, str]] = []  # (seconds into the run, rollout)
        self.finals: dict[tuple[str, int], tuple[int, str]] = {}  # (replica, shard) -> (version, digest)
        self.stall: dict[str, float] = defaultdict(float)
        self.moved: dict[str, int] = defaultdict(int)
        self.served: dict[tuple[str, str], int] = defaultdict(int)
        self.aborted: dict[str, int] = defaultdict(int)
        self.abort_messages: list[str] = []
        self.empty: dict[str, int] = defaultdict(int)
        self.closed = 0  # steps whose row is final

    @property
    def latest(self) -> int:
        """The trainer's newest version published by every shard (0: none yet)."""
        return min(self.published.values()) if len(self.published) == self.shards else 0

    def holds(self, rollout: str) -> int:
        """The version every shard of ``rollout`` holds (0: some shard holds none)."""
        return min(self.held.get((rollout, i), 0) for i in range(self.shards))

    def all_ready(self) -> bool:
        return all((r, i) in self.ready for r in self.rollouts for i in range(self.shards))

    def rollouts_final(self) -> bool:
        return all((r, i) in self.finals for r in self.rollouts for i in range(self.shards))

    def done(self) -> bool:
        return self.rollouts_final() and all(("trainer", i) in self.finals for i in range(self.shards))

    def alive(self) -> list[str]:
        """Rollouts not yet done."""
        return [r for r in self.rollouts if not all((r, i) in self.finals for i in range(self.shards))]

    def killable(self) -> list[str]:
        """Rollouts not yet done whose every shard has opened its handle and registered (a kill
        before that tests nothing of TensorHub: the processes were still starting)."""
        return [r for r in self.alive() if all((r, i) in self.ready for i in range(self.shards))]

    def allowed(self) -> int:
        """The newest version the trainer may publish now: at most ``MAX_STALENESS`` ahead of every
        rollout (but one restarting after a SIGKILL, which starts empty, is not waited for)."""
        held = [self.holds(r) for r in self.rollouts if r not in self.recovering]
        return (min(held) if held else self.steps) + MAX_STALENESS

    def max_lag(self, rollout: str) -> int:
        return max((lags[rollout] for lags in self.lag.values() if rollout in lags), default=0)

    def on_event(self, ev: tuple) -> None:
        kind = ev[0]
        if kind == "train":
            _, shard, step, loss, stall, waited = ev
            self.published[shard] = step
            self.trainer_stall += stall / self.shards
            self.trainer_waited += waited / self.shards
            if shard == 0:
                self.losses[step] = loss
        elif kind == "eval":
            if ev[1] == 0:
                self.final_loss = ev[2]
        elif kind == "final" and ev[1] == "trainer":
            self.finals[("trainer", ev[3])] = (ev[4], ev[5])
        else:
            _, replica, incarnation, shard = ev[:4]
            if incarnation != self.incarnation[replica]:
                return
            if kind == "ready":
                self.ready.add((replica, shard))
            elif kind == "pulled":
                version, stall, nbytes, sources = ev[4:]
                self.held[(replica, shard)] = version or 0
                self.stall[replica] += stall / self.shards
                self.moved[replica] += nbytes
                for src in sources:
                    self.served[(src.split("/")[0], replica)] += 1
                if replica in self.recovering and self.holds(replica) > 0:
                    self.recovering.discard(replica)
            elif kind == "aborted":
                self.aborted[replica] += 1
                self.held[(replica, shard)] = 0
                if len(self.abort_messages) < 5:
                    self.abort_messages.append(f"{replica}/{shard}: {ev[4]}")
            elif kind == "empty":
                self.empty[replica] += 1
                self.held[(replica, shard)] = 0
            elif kind == "final":
                self.finals[(replica, shard)] = (ev[4], ev[5])
        self._sample()

    def kill(self, rollout: str, at: float) -> None:
        """``rollout`` was SIGKILLed (and restarted as a new incarnation)."""
        self.incarnation[rollout] += 1
        for i in range(self.shards):
            self.held[(rollout, i)] = 0
            self.finals.pop((rollout, i), None)
            self.ready.discard((rollout, i))
        self.killed.append((at, rollout))
        self.recovering.add(rollout)
        self._sample()

    def _sample(self) -> None:
        v = self.latest
        if v < 1:
            return
        for r in self.rollouts:
            if r in self.recovering:
                self.restarting[v].add(r)
            self.lag[v][r] = max(self.lag[v].get(r, 0), v - self.holds(r))

    def newly_closed(self, everything: bool = False) -> list[int]:
        """Steps whose row became final: a newer version is out, or the run is over."""
        upto = self.latest if (everything or self.rollouts_final()) else self.latest - 1
        fresh = list(range(self.closed + 1, upto + 1))
        self.closed = max(self.closed, upto)
        return fresh

    def cell(self, step: int, rollout: str) -> str:
        lag = self.lag.get(step, {}).get(rollout)
        return ("-" if lag is None else str(lag)) + ("*" if rollout in self.restarting.get(step, ()) else "")

    def header(self) -> str:
        return f"    {'step':>4} {'loss':>7}  " + "  ".join(f"{r:>10}" for r in self.rollouts)

    def row(self, step: int) -> str:
        loss = self.losses.get(step)
        cells = "  ".join(f"{self.cell(step, r):>10}" for r in self.rollouts)
        return f"    {step:>4} {(f'{loss:.3f}' if loss is not None else '-'):>7}  {cells}"


# ---- the views ---------------------------------------------------------------------------------


def _legend(chaos: bool) -> str:
    return ("  per step: the loss it trained on, and each rollout's staleness (the trainer's newest version minus\n"
            "  the version the rollout holds, the most it reached while that step was the newest; 1 = it held the\n"
            f"  previous version when this one came out; at most {MAX_STALENESS} is required"
            + ("; * = SIGKILLed or restarting)" if chaos else ")"))  # fmt: skip


class _PlainView:
    """One line per step as it closes (or all of them at the end, with ``--quiet``)."""

    def __init__(self, progress: _Progress, quiet: bool, legend: str) -> None:
        self.p, self.quiet, self.legend = progress, quiet, legend
        self.started = False
        self.held_back: list[str] = []

    def _emit(self, lines: list[str]) -> None:
        if not self.started:
            lines = [self.legend, self.p.header(), *lines]
            self.started = True
        if self.quiet:
            self.held_back += lines
        else:
            print("\n".join(lines), flush=True)

    def note(self, line: str) -> None:
        if not self.quiet:
            print(line, flush=True)

    def refresh(self, closed: list[int]) -> None:
        if closed:
            self._emit([self.p.row(s) for s in closed])

    def close(self) -> None:
        if not self.started:
            self._emit([])
        if self.held_back:
            print("\n".join(self.held_back), flush=True)


def _rich_view(p: _Progress, shown: int = 12) -> Any:
    """The live view: the last ``shown`` closed steps and the open one, and a status line."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    table = Table()
    table.add_column("step", justify="right")
    table.add_column("loss", justify="right")
    for r in p.rollouts:
        table.add_column(r, justify="right")
    for s in range(max(1, p.closed - shown + 1), p.latest + 1):
        cells = []
        for r in p.rollouts:
            lag = p.lag.get(s, {}).get(r, 0)
            if r in p.restarting.get(s, ()):
                style = "dim"
            else:
                style = "red" if lag > MAX_STALENESS else "green" if lag <= 1 else "yellow"
            now = f" v{p.holds(r)}" if s == p.latest and s > p.closed else ""
            cells.append(Text(p.cell(s, r) + now, style=style))
        loss = p.losses.get(s)
        table.add_row(str(s), f"{loss:.3f}" if loss is not None else "-", *cells)
    status = (f"trainer v{p.latest}/{p.steps}   moved {sum(p.moved.values()) / 1e6:.1f} MB   "
              f"aborted {sum(p.aborted.values())}   empty {sum(p.empty.values())}")  # fmt: skip
    if p.killed:
        status += f"   SIGKILLed {len(p.killed)}"
    return Group(
        Text("staleness per step: the most versions each rollout was behind the trainer's newest"),
        table,
        Text(f"at most {MAX_STALENESS} is required   n*: SIGKILLed or restarting   vN: the version it holds now", style="dim"),
        Text(status),
    )


class _RichView(_PlainView):
    """A live table (the last steps, the open step, a status line), redrawn as events come; the
    plain lines are printed when it ends, so that they stay in the scrollback."""

    def __init__(self, progress: _Progress, legend: str) -> None:
        from rich.console import Console
        from rich.live import Live

        super().__init__(progress, quiet=True, legend=legend)
        self.live = Live(_rich_view(progress), console=Console(), refresh_per_second=8, transient=True)
        self.live.start()

    def note(self, line: str) -> None:
        self.live.console.print(line.strip(), highlight=False)

    def refresh(self, closed: list[int]) -> None:
        super().refresh(closed)
        self.live.update(_rich_view(self.p))

    def close(self) -> None:
        self.live.stop()
        super().close()


def _view(progress: _Progress, quiet: bool, chaos: bool) -> _PlainView:
    if not quiet and sys.stdout.isatty():
        try:
            return _RichView(progress, _legend(chaos))
        except ImportError:  # rich is optional (the dev extra installs it)
            pass
    return _PlainView(progress, quiet, _legend(chaos))


def _checks(p: _Progress, shards: int) -> list[tuple[bool, str, str]]:
    """What the README promises, each as (held, the line that reports it, why it failed)."""
    killed = {r for _, r in p.killed}
    checked = [r for r in p.rollouts if r not in killed]
    if not killed:
        exempt = ""
    elif checked:
        exempt = f"not checked: {', '.join(sorted(killed))}, SIGKILLed"
    else:
        exempt = "not checked: every rollout was SIGKILLed"
    wrong = []
    for r in p.rollouts:
        for i in range(shards):
            got, want = p.finals.get((r, i)), p.finals.get(("trainer", i))
            if got is None or want is None or got != want:
                have = f"version {got[0]} digest {got[1]}" if got else "nothing (no final report)"
                wrong.append(f"{r} shard {i} ends with {have}" + (f"; the trainer's is v{want[0]} {want[1]}" if want else ""))
    checks = [(not wrong, "every rollout holds the trainer's final weights, byte for byte", "; ".join(wrong[:3]))]
    first, last = p.losses.get(1), p.final_loss
    if first is None or last is None:
        checks.append((False, "the loss fell", "no loss was measured"))
    else:
        checks.append((last < first, f"the loss fell ({first:.3f} -> {last:.3f})", f"the loss did not fall ({first:.3f} -> {last:.3f})"))
    aborted, empty = sum(p.aborted[r] for r in checked), sum(p.empty[r] for r in checked)
    example = f": {p.abort_messages[0]}" if p.abort_messages else ""
    checks.append((aborted == 0 and empty == 0, "no update aborted, no handle left empty" + (f" ({exempt})" if exempt else ""),
                   f"{aborted} aborted updates, {empty} empty handles{example}"))  # fmt: skip
    lagged = [f"{r} lagged {p.lag[s][r]} versions at step {s}" for s in sorted(p.lag) for r in checked if p.lag[s].get(r, 0) > MAX_STALENESS]
    worst = max((p.max_lag(r) for r in checked), default=0)
    checks.append((not lagged, f"no rollout lagged the trainer by more than {MAX_STALENESS} versions at any step (max {worst}{'; ' + exempt if exempt else ''})",
                   "; ".join(lagged[:3])))  # fmt: skip
    return checks


def _print_summary(p: _Progress, elapsed: float, address: str, before: dict, after: dict | None, chaos: bool) -> None:
    killed = {r for _, r in p.killed}
    first, last = p.losses.get(1), p.final_loss
    loss = f"{first:.3f} -> {last:.3f}" if first is not None and last is not None else "not measured"
    print(f"\nsummary ({elapsed:.1f} s):")
    print(f"  versions published: {p.latest}   loss {loss} (step 1's batch -> the final weights on a fresh batch)")
    print(f"  trainer stall in unpublish (draining readers, offloading the last copy): {p.trainer_stall:.2f} s; "
          f"waiting for rollouts to come within {MAX_STALENESS} versions: {p.trainer_waited:.2f} s")  # fmt: skip
    print(f"  {'rollout':<12} {'final':>6} {'moved MB':>9} {'stall s':>8} {'aborted':>8} {'empty':>6} {'max staleness':>14}")
    for r in p.rollouts:
        v = min(p.finals.get((r, i), (0, ""))[0] or 0 for i in range(p.shards))
        print(f"  {r:<12} {('v' + str(v)):>6} {p.moved[r] / 1e6:>9.1f} {p.stall[r]:>8.2f} {p.aborted[r]:>8} "
              f"{p.empty[r]:>6} {str(p.max_lag(r)) + ('*' if r in killed else ''):>14}")  # fmt: skip
    counts = f"  aborted updates {sum(p.aborted.values())}, empty handles seen by rollouts {sum(p.empty.values())}"
    if after is None:
        print(f"{counts}; the server at {address} did not answer for its counters")
    else:
        d = {k: after.get(k, 0) - before.get(k, 0) for k in ("redecided", "pins", "pins_expired", "offloads")}
        print(f"{counts}; the server's counters over this run: re-decisions {d['redecided']}, pins {d['pins']}, "
              f"pins expired {d['pins_expired']}, offloads {d['offloads']}")  # fmt: skip
    if chaos:
        print(f"  chaos: {len(p.killed)} rollout replicas SIGKILLed mid-run and restarted under their names"
              + (f" ({', '.join(f'{v} at {t:.1f} s' for t, v in p.killed)})" if p.killed else ""))  # fmt: skip
    print("  who served whom (shard pulls):")
    for (src, dst), n in sorted(p.served.items()):
        print(f"    {src:>12} -> {dst:<12} {n}")


# ---- the run -----------------------------------------------------------------------------------


def _server_address(server: str | None) -> str:
    from tensorhub.runtime.embedded import embedded_address, parse_servers

    spec = server or os.environ.get("TENSORHUB_SERVER") or None
    return parse_servers(spec)[0] if spec else embedded_address()


def _server_stats(address: str, timeout: float) -> dict[str, int] | None:
    """The server's event counters, or None if it does not answer."""
    from tensorhub.core.errors import TensorHubError
    from tensorhub.tools.admin import server_status

    try:
        return dict(server_status(address, timeout=timeout).stats)
    except TensorHubError:
        return None


def run_demo(args: argparse.Namespace) -> int:
    """Run the demo; 0 on success, 1 naming each check that failed."""
    a = {k: getattr(args, k) for k in ("steps", "rollouts", "shards", "width", "layers", "server", "timeout")}
    if a["steps"] < 1 or a["rollouts"] < 1 or a["shards"] < 1 or a["width"] % 8:
        print("tensorhub demo: --steps, --rollouts and --shards must be >= 1, --width a multiple of 8", file=sys.stderr)
        return 1
    quiet = bool(getattr(args, "quiet", False))
    chaos = bool(getattr(args, "chaos", False))
    seed = getattr(args, "seed", None)
    seed = 0 if seed is None else seed
    rng = random.Random(seed)
    address = _server_address(a["server"])
    before = _server_stats(address, 0.5) or {}  # the embedded server may not be up yet: it starts at 0
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "tensorhub.handles.api"])
    events = _Events(ctx)
    go, finish = ctx.Event(), ctx.Event()
    rollouts = [f"rollout-{j}" for j in range(a["rollouts"])]
    p = _Progress(a["steps"], a["shards"], rollouts)

    barriers = {r: ctx.Barrier(a["shards"]) for r in rollouts}  # one per incarnation of a rollout

    def rollout_proc(r: str, i: int) -> Any:
        return events.process(_rollout, (r, p.incarnation[r], i, a, events.SLOT, barriers[r]), f"{r}/{i}")

    allowed = ctx.Value("q", MAX_STALENESS)
    sync = {"go": go, "finish": finish, "together": ctx.Barrier(a["shards"]), "allowed": allowed}
    procs = [events.process(_trainer, (i, a, events.SLOT, sync), f"trainer/{i}") for i in range(a["shards"])]
    procs += [rollout_proc(r, i) for r in rollouts for i in range(a["shards"])]
    print(f"tensorhub demo: trainer x{a['shards']} shards, {a['rollouts']} rollouts x{a['shards']} shards, "
          f"{a['steps']} steps, server {a['server'] or os.environ.get('TENSORHUB_SERVER') or address + ' (embedded default)'}"
          + (", chaos" if chaos else ""))  # fmt: skip
    print(f"  task: next token of sequences counting up by one modulo {PERIOD} (vocabulary {VOCAB}), Adam lr {LEARNING_RATE:g}; "
          f"seeds: model {INIT_SEED}, data {DATA_SEED}" + (f", chaos {seed}" if chaos else ""), flush=True)  # fmt: skip
    t_start = time.monotonic()
    next_kill = t_start + rng.uniform(1.0, 3.0) if chaos else float("inf")
    killed_at_step = -1  # the trainer's version at the last kill: the next waits for a newer one
    for proc in procs:
        events.start(proc)
    view = _view(p, quiet, chaos)
    deadline = t_start + a["timeout"]
    failure = None
    try:
        while not p.done() and time.monotonic() < deadline:
            if time.monotonic() >= next_kill and killed_at_step < p.latest < a["steps"]:
                alive = p.killable()
                if not alive:  # every replica is still starting (or restarting): a moment later
                    next_kill = time.monotonic() + 0.2
                else:
                    victim = rng.choice(alive)
                    next_kill = time.monotonic() + rng.uniform(1.0, 3.0)
                    killed_at_step = p.latest
                    for proc in procs:  # the whole replica dies, and comes back
                        if proc.name.startswith(f"{victim}/"):
                            if proc.is_alive() and proc.pid is not None:  # alive: started, so it has one
                                os.kill(proc.pid, signal.SIGKILL)
                            proc.join(10)
                    p.kill(victim, time.monotonic() - t_start)
                    allowed.value = p.allowed()
                    barriers[victim] = ctx.Barrier(a["shards"])
                    for k, proc in enumerate(procs):
                        if proc.name.startswith(f"{victim}/"):
                            procs[k] = rollout_proc(victim, int(proc.name.rsplit("/", 1)[1]))
                            events.start(procs[k])
                    view.note(f"  chaos: SIGKILLed {victim} at {p.killed[-1][0]:.1f} s; restarting it")
            dead = [proc for proc in procs if proc.exitcode not in (None, 0)]  # (a SIGKILLed one is replaced)
            if dead:
                failure = f"{dead[0].name} exited with code {dead[0].exitcode}"
                break
            try:
                ev = events.get(timeout=0.5)
            except TimeoutError:
                view.refresh([])
                continue
            p.on_event(ev)
            allowed.value = p.allowed()
            if p.all_ready():
                go.set()
            if p.rollouts_final():
                finish.set()
            view.refresh(p.newly_closed())
        else:
            if not p.done():
                behind = [f"{r} holds v{p.holds(r)}" for r in p.alive()]
                failure = f"timed out after {a['timeout']:g} s with the trainer at v{p.latest}" + (f": {', '.join(behind)}" if behind else "")
    finally:
        go.set()
        finish.set()
        try:
            view.refresh(p.newly_closed(everything=True))
        finally:
            view.close()
        stop_by = time.monotonic() + 30  # for all of them together: then they are killed
        for proc in procs:
            proc.join(max(0.1, stop_by - time.monotonic()))
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5)
    elapsed = time.monotonic() - t_start
    after = _server_stats(address, 5.0)
    failed: list[str] = [failure] if failure is not None else []
    if failure is None:
        bad = [proc.name for proc in procs if proc.exitcode != 0]
        if bad:
            failed.append(f"processes failed: {', '.join(bad)}")

    checks = _checks(p, a["shards"])
    failed += [why for ok, _, why in checks if not ok]
    _print_summary(p, elapsed, address, before, after, chaos)
    print("  checks:")
    for ok, line, why in checks:
        print(f"    {line}: {'ok' if ok else 'FAILED'}" + ("" if ok else f" ({why})"))
    if failed:
        print(f"tensorhub demo FAILED: {'; '.join(failed)}", file=sys.stderr)
        return 1
    return 0
