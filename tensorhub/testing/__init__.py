"""Testing helpers that ship with the library: the transport conformance suite.

Theory of operation
-------------------
:func:`check_transport` takes a transport (a registered name, a ``"module:Class"`` path, a
class, or a factory called with an options dict) and runs named checks against it, each on
fresh instances: a *holder* that serves :class:`~tensorhub.transports.buffers.ShardBuffers` through a
resolver (a dict of ``(region, version) -> buffers``, as the engine's resolver would answer),
and one or more *readers* that read from it over the transport. Every check is bounded (each
read, each close, each command to the holder and each check has a timeout), so a transport that
hangs fails the suite instead of hanging it.

A check never touches the holder directly: it asks its *pair* (``p.hold(shard)``,
``p.reset(shard, version, verified)``, ``p.advance(shard, n)``, ``p.generation(shard)``,
``p.write(shard, offset, data)``, ``p.expose/withdraw(shard)``, ``p.feed(...)``,
``p.close_holder()``, ``p.guard(token)`` and ``p.refusals()`` (a grant check that admits one
token, and what it refused)...), and the pair runs that on the holder's side, wherever it is:
in this process, or in the holder process (below). The holder's side is :class:`_HolderSide`, the same
code in both places.

What the checks compare is the shard's *transfer byte space*: the holder's space is filled with
seeded random bytes through :meth:`ShardBuffers.views`, and a reader's bytes are read back the
same way. The suite never looks at the tensors themselves (tiny ones live in packs). A shard is
named by a small description (its kind, ``"mixed"`` or ``"large"``, and a seed): both sides
make the same bytes from it, so they are never shipped between processes.

In this process, the holder's buffers are a subclass of ShardBuffers whose
``views``/``copy_out`` can run a hook once, after the transport took the memory to copy it:
that is how the suite changes the generation (``seqlock_during``) or closes the holder
(``peer_death``) *during* a read, deterministically. A transport that never reads the holder's
memory through those methods (a true RDMA transport) cannot be checked this way: those two
checks then fail saying so, and its tests skip them (or run the suite across processes).

Across processes
----------------
With ``holder_process=True`` the holder side of every check runs in a child process, so that a
transport that reads another process's memory (NIXL over UCX, ``process_vm_readv``) is checked
across address spaces. The child makes the holder transport itself, so the transport is given
by its registered name or a ``"module:Class"`` path (a class importable at module level also
does) with msgpack-able options; a name registered at run time with ``register_transport`` is
unknown to the child (use its path). One child serves the whole :func:`check_transport` call,
one holder transport per pair; it is started with the ``spawn`` (or ``forkserver``) method and
replaced only after a check killed it. The checking process talks to it over a pipe, msgpack
frames only (never pickle), one command at a time, each answered within a timeout; the child
exits when the pipe closes, and the suite kills it if it does not answer.

The checks are the same, and fail with the same messages, except:

- ``seqlock_during``: the hook runs in the holder process, where the holder's transport takes
  its memory to send it (a two-sided transport such as ``tcp``), so the read across a change
  is as deterministic as in this process. Then, in addition, the holder process changes the
  holding in a tight loop (new generation with nothing verified, the bytes of one of two
  seeded contents chosen by the generation, everything verified) while reads run; every read
  must either fail with a TransportError (not RangeNotReady) or return a generation the holder
  had with exactly that generation's bytes, and a read after the loop stops must return the
  final generation and its bytes. A one-sided transport (NIXL, ``process_vm_readv``) runs no
  holder code during a read, so no hook fires in its copy: for it only the loop runs, which
  catches a broken seqlock with high probability, not with certainty.
- ``peer_death``: instead of closing the holder from inside the copy, the suite SIGKILLs the
  holder process while a large read (up to 64 MiB) of a partial holder, whose progress the
  child advances slowly, is in flight: the read must fail with a TransportError (not
  RangeNotReady) promptly, and so must a read from the dead peer after it. The half that
  closes the holder while a read waits runs as in this process. A fresh child is started at
  once for the checks after it.
- ``endpoint_msgpack`` checks the holder's endpoint in the holder process, where it is made;
  readers here use that endpoint as it came through msgpack.

Transports that only reach their own process (``memory``) cannot be checked across processes.

Randomness comes from one seed (:data:`DEFAULT_SEED`, from ``$TENSORHUB_SEED`` like the test
suite's); each check derives its own generator from the seed and its name, so a check does the
same thing whichever others run. The seed is in every failure message.

Failures are :class:`AssertionError` naming the check (``check 'seqlock_during' failed``), the
transport and the seed.

Where things are
----------------
:mod:`~tensorhub.testing.conformance` has the entry points and :data:`CHECKS`; the checks are
in ``endpoint_checks``, ``read_checks``, ``seqlock_checks``, ``closing_checks``,
``cuda_checks`` and ``grant_checks`` (registered with :mod:`~tensorhub.testing.registry`, run in that order). A check
gets a :class:`~tensorhub.testing.pairs._Ctx` and its pairs (``pairs``); the holder's side is in
``holders``, the holder process in ``holder_process``, the shards in ``shards``, what checks
assert in ``assertions``, how the transport under test is made in ``under_test``, and the
suite's numbers and time limits in ``limits``. ``fuzzing`` (not imported here) sends hostile
frames to a real server.
"""

from __future__ import annotations

# The public names (__all__), and those the suite's own tests use (``as`` marks them re-exported).
# Tests shorten a limit by patching it where it lives: ``tensorhub.testing.limits``.
from tensorhub.testing.conformance import CHECKS, DEFAULT_SEED, check_transport, check_transport_async
from tensorhub.testing.holder_process import _HolderProcess as _HolderProcess
from tensorhub.testing.holder_process import _InChild as _InChild
from tensorhub.testing.holders import _InProcess as _InProcess
from tensorhub.testing.limits import _WRITE_CHUNK as _WRITE_CHUNK
from tensorhub.testing.limits import REGION as REGION
from tensorhub.testing.limits import SENTINEL as SENTINEL
from tensorhub.testing.limits import VERSION as VERSION
from tensorhub.testing.pairs import _Ctx as _Ctx
from tensorhub.testing.shards import _bytes as _bytes
from tensorhub.testing.under_test import TransportFactory

__all__ = ["CHECKS", "DEFAULT_SEED", "TransportFactory", "check_transport", "check_transport_async"]
