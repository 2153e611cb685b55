"""The data plane, measured: one holder -> reader pull over ``tcp`` against raw sockets, what
packing saves in registrations and transfer operations, what verification costs, what
``publish`` costs the trainer, and how much memory a pull takes on either side.

Workload: two shards of about ``--size-mib`` (``64x16MiB``, ``model-500``) pulled from one holder
process by this one, ``--repeats`` times per path, in the sections below.
Baseline: raw sockets (and raw NIXL, memcpy, one-thread hashing) on the same bytes, same run.
Goal: per section (``bench_transfer_report.py``), e.g. tcp >= 0.9x the raw socket.

Two shards, each about ``--size-mib`` MiB (default 1,024), with seeded content:

- ``64x16MiB``: 64 tensors of equal size (16 MiB at full size), uint8 and bfloat16 alternating;
- ``model-500``: 500 tensors of seeded sizes, about half under 64 KiB (norms, biases; fp32 and
  bf16), the rest large bf16 weights, in a shuffled, model-like order.

The holder is a separate process (multiprocessing ``spawn``) that serves from its own memory;
the reader is this process (section 6: separate processes too). The sections (``--sections``, default all) measure:

1. ``plan``: registrations and transfer operations of one pull, with packing (the default
   ``pack_threshold``, 2 MiB) and without (0), from the layout's read plan as the engine uses
   it (``plan_of(layout).reads(max(engine chunk, layout.chunk_bytes))``): ``regions`` (what a
   one-sided transport registers: ``len(ShardBuffers.regions)``), ``reads`` per pull (one
   request each) and ``segments`` (the memory pieces those reads touch: descriptors, for a
   one-sided transport). When the product path runs, the reader handle's ``last_pull``
   (``PullStats``) must agree: after the timed product pulls (packing on) and after one extra
   pull of a copy published with ``$TENSORHUB_PACK_THRESHOLD=0`` (packing off).
   Goal (DESIGN §4: packing keeps registrations and transfer ops near the number of large
   tensors): with packing, ``regions <= large + packs`` (one per tensor of at least 2 MiB, plus
   the packs) and ``reads`` and ``segments <= large + packs + shard / read size`` (every
   region is touched, and a read size cuts the shard into at least that many pieces).
   The ``off`` row is the reference packing is compared with; it has no goal.
2. ``transfer``: for each shard and repeat, between the same two processes:

   - ``baseline``: plain sockets, one connection: the holder ``sendall``s each tensor's memory
     in layout order, the reader ``recv_into``s straight into its preallocated tensors;
   - ``tcp``: ``tensorhub.transports.tcp.TcpTransport`` driven the way the engine drives it: a
     ``ReplicationSession`` over the layout's read plan (whole checksum units per read, of up
     to 8 MiB or ``$TENSORHUB_CHUNK_BYTES``, as in the engine) issues reads in transfer order
     (packs, then large tensors), ``--streams`` at once, each one ``TcpTransport.read`` into the
     reader's ``ShardBuffers``. The holder packed its tiny tensors before serving (as the
     publish job does); the reader unpacks them after the last read, inside the timed pull;
   - ``tcp, no packing`` (only with ``--tcp-unpacked``): the same driver over the same tensors
     laid out with ``pack_threshold`` 0 (no packs, nothing to unpack): what packing costs tcp;
   - ``product``: the full path: a real server (``python -m tensorhub server``), the holder
     process publishes the shard as a trainer (``tensorhub.open`` + ``register`` +
     ``publish(1)``) and this process times ``replicate(1)`` into the same tensors (then
     ``unpublish`` for the next repeat). ``--no-product`` skips it (and sections 4 and 5,
     which need a server).

   Goal: ``tcp >= 0.9 x baseline`` on both shards (the model-like one is the harder: 500
   tensors, half of them tiny). Under each shard a line splits the tcp pull: when its last read
   landed (against the baseline's whole pull), then the unpack, which runs after it.
3. ``verify``: ``tcp+verify`` is the same driver with ``verify=True``: every read that lands is
   hashed in a worker thread (``checksum.first_mismatch`` over the read's checksum units,
   against the xxh3-64 checksums the holder computed with ``checksum.compute`` and sent over the
   control pipe) while the next reads are on the wire, exactly as the engine does; a read
   counts once verified, and its tiny tensors are unpacked right then, in the background, as
   the engine does (plain ``tcp`` unpacks everything after the last read). Goal: ``tcp+verify / tcp <= 1.10`` in time (verification adds at
   most 10 %). To say where the extra time comes from, the table shows when the last read
   landed without and with hashing (hashing threads competing with the transfer for cores
   slow the reads down), the hashing still left after the last read (the tail that does not
   overlap), the time spent in the hashing threads, and the time one thread takes to hash
   the whole shard alone (what verification must add on a host with no spare core: a
   loopback transfer keeps a core busy on each side). Beside it, single-thread speeds
   measured for each shard in rounds that interleave them (``max(5, --repeats)`` after a
   warm-up): the hash of the whole shard (``checksum.compute``, per unit as a publisher
   does), and over as many bytes xxh3 of one buffer and memcpy into preallocated memory (a
   torch ``copy_`` with one intra-op thread, and a ``memoryview`` slice assignment). Goal:
   the shard's hash at least as fast as the faster memcpy (hashing reads the bytes once; a
   copy reads and writes them).
4. ``publish``: the trainer's cost of ``publish(v)`` on a real handle (this process, the
   benchmark's server) for model-like shards of ``--size-mib`` / 16, / 4 and x 1, each
   ``--publish-repeats`` times after a warm-up, in unpublish / publish(v + 1) rounds; and
   separately how long after the call started the background job (pack, hash, declare) has
   declared the checksums (the engine's ``WaitPublished``, what ``unpublish`` waits for).
   The sizes take turns within each round, so that other load on the host hits them alike
   (a model-like shard has at least ~23 MiB: 250 weights of at least 64 KiB; the table shows
   the real sizes). Goal: publish does not grow with the shard: median at the largest size
   ``<= 1.5 x`` the median at the smallest (a 16x size range at the default sizes).
5. ``memory`` (``model-500``): peak RSS minus RSS right after ``register``, in the holder
   process (a window from its trainer's register through the publish job and every pull it
   served afterwards: the timed baseline, tcp and product pulls, and the one below) and in a
   fresh reader process (from its register through one ``replicate`` from that trainer). The peak is the kernel's high-water mark ``VmHWM``,
   reset to the current RSS right after register by writing ``5`` to
   ``/proc/self/clear_refs``, read at the window's end; where that reset is refused, a thread
   samples ``VmRSS`` every 2 ms instead (and may miss a shorter spike); the method used is
   printed. The memory ``register`` itself takes (mostly the pack buffers: a second copy of the
   packed tensors, made resident when they are zeroed) is reported beside it, outside the
   goal. Goal: ``<= 64 MiB`` each.
6. ``rdma``: the one-sided and same-host transports, driven directly (``start``, ``serve``,
   ``expose``, ``read``, as ``tensorhub.testing`` drives them) with their default options, each
   against a baseline: ``nixl`` and ``rdma_copy`` against a raw NIXL READ of the same bytes
   (two bare ``nixl_agent``s with NIXL's defaults: the holder registers the same regions, the
   reader its destination, metadata exchanged, one READ transfer request per read of the plan
   with a descriptor per segment, 4 in flight, polled as the transports poll), ``local``
   against a one-thread torch ``copy_`` of the same regions in one process. One holder process
   (the shard seeded, packed and verified, as a publish job leaves it) and 1, 2 and 4 reader
   processes, each pulling the whole shard at once (released together by a start time on the
   host's monotonic clock): the engine's read plan (whole checksum units of up to 8 MiB), the
   transport's ``streams`` reads in flight (``asyncio.gather`` under a semaphore), each read
   after the first passing the generation the first returned. ``GB/s total`` is all readers'
   bytes over the time from the first start to the last end. The processes (5, started once:
   importing torch costs seconds) serve every shard, reader count and repeat. NIXL agents
   exist only while their own path runs: an idle agent's progress thread keeps about half a
   core busy (the ``idle cores`` column; NIXL's Python API sets no progress-thread delay), and
   two more idle agents in each process cut a raw pull from 1.8 to 0.6 GB/s on 2 cores. So a NIXL
   path and its baseline take turns pull by pull, each turn starting its agents, making its
   connections with one untimed read per reader, pulling once (``--warmup`` more, untimed, on
   the first turn) and closing them; ``local`` and memcpy alternate pull by pull. Registration
   is reported apart from throughput: ``expose()`` of the shard on each transport right after
   its agent started (holder and readers), again ``--repeats`` times after ``withdraw`` in the
   holder, and NIXL ``register_memory`` of the same regions for the raw baseline; ``start()``
   beside it (``rdma_copy`` registers its staging pool there, never the shard). Every pull is
   verified: xxh3-64 of every checksum unit of the reader's transfer space (packs and large
   tensors; the packs are not unpacked) against the holder's. ``--ucx-tls tcp`` runs the NIXL
   phases again with ``$UCX_TLS=tcp`` set in fresh helper processes. Goals (1 GiB shards):
   ``nixl >= 0.9 x`` raw NIXL for every reader count; ``local >= 0.7 x`` memcpy with one
   reader; ``rdma_copy`` has none (its ratio is printed). The section needs no server.

Before every transfer the reader's tensors (and its pack buffers) are zeroed; after it, a CRC-32
of every tensor is compared with the one the holder computed over its seeded content: a
transfer that moved wrong bytes, or verified bytes that failed their checksums, stops the
benchmark with an error (exit status 1). A goal missed is reported (MISS), not an error: the
exit status is 0. Each timed path gets ``--warmup`` untimed transfers (connections,
first-touch effects), then ``--repeats`` timed ones, in an order that rotates each repeat.
Figures are medians in GB/s (10^9 bytes/s) and ratios to what was measured in the same run:
``vs baseline`` is the ratio of the medians (what goals are checked on); ``paired`` is the
median of each repeat's ratio to that same repeat's baseline, steadier when other work on the
host comes and goes. ``CPU s/GB`` is the CPU time that the reader and the holder processes (all
their threads) spent per GB moved, median: the cost of a path, which other load on the host
disturbs less than its speed. ``--json FILE`` writes every figure, every sample behind it and
every verdict.

Usage: python benchmarks/bench_transfer.py [--size-mib N] [--streams S] [--repeats R]
       [--sections plan,transfer,verify,publish,memory,rdma] [--publish-repeats P] [--ucx-tls TLS]
       [--json FILE]
Goals: packing keeps regions/reads/segments near the large tensors; tcp >= 0.9 x baseline;
tcp+verify <= 1.10 x tcp; hash >= memcpy; publish independent of size; <= 64 MiB RSS per side;
nixl >= 0.9 x raw NIXL READ; local >= 0.7 x memcpy (one reader).

The code, beside this entry point (``main``): the harness (``benchmarks/harness``: the shards,
their seeded content and byte checks in ``shards.py``; RSS, CPU time and medians in
``measure.py``; the server and helper processes in ``processes.py``),
``bench_transfer_baselines.py`` (raw socket, one thread's hash and memcpy, raw NIXL READ),
``bench_transfer_paths.py`` (the TensorHub pulls, the read plan's counts),
``bench_transfer_sections.py`` (sections 1 to 5: the holder process and the drivers),
``bench_transfer_rdma.py`` (section 6) and ``bench_transfer_report.py`` (the goals, the tables).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_transfer_rdma import bench_rdma, rdma_available
from benchmarks.bench_transfer_report import (
    GOAL_HASH,
    GOAL_LOCAL,
    GOAL_NIXL,
    GOAL_PUBLISH,
    GOAL_RSS_MIB,
    GOAL_TCP,
    GOAL_VERIFY,
    Report,
    report_memory,
    report_plan,
    report_publish,
    report_rdma,
    report_transfer,
    report_verify,
)
from benchmarks.bench_transfer_sections import bench_publish, bench_shard
from benchmarks.harness import BenchmarkError, start_server, stop_process, write_json
from benchmarks.harness.shards import (
    ENGINE_CHUNK,
    model_spec,
    uniform_spec,
)
from tensorhub.runtime.actor import new_event_loop

SECTIONS = ("plan", "transfer", "verify", "publish", "memory", "rdma")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mib", type=int, default=1024, help="bytes of each shard, in MiB (default 1024)")
    ap.add_argument("--streams", type=int, default=4, help="concurrent reads of one pull (tcp transport option)")
    ap.add_argument("--repeats", type=int, default=5, help="timed transfers per path (default 5)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed transfers per path first")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shards", default="64x16MiB,model-500", help="comma-separated subset of: 64x16MiB, model-500")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of: {', '.join(SECTIONS)}")
    ap.add_argument("--tcp-unpacked", action="store_true", help="also time tcp pulls of the shard laid out without "
                                                                 "packing (pack_threshold 0): what packing costs tcp")  # fmt: skip
    ap.add_argument("--publish-repeats", type=int, default=10, help="timed publishes per size (section publish)")
    ap.add_argument("--no-product", action="store_true", help="skip the full path (server + publish + replicate), "
                                                               "and the sections that need it (publish, memory)")  # fmt: skip
    ap.add_argument("--ucx-tls", default="", help="section rdma: run it again with $UCX_TLS set to this in its "
                                                   "processes (e.g. tcp), after the run with UCX's default transports")  # fmt: skip
    ap.add_argument("--timeout", type=float, default=120.0, help="bound on every wait, in seconds")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.size_mib < 1 or args.streams < 1 or args.repeats < 1 or args.warmup < 0 or args.publish_repeats < 1:
        ap.error("--size-mib, --streams, --repeats and --publish-repeats must be >= 1, --warmup >= 0")
    total = args.size_mib << 20
    shards = {"64x16MiB": uniform_spec(total), "model-500": model_spec(total, args.seed)}
    wanted = [s.strip() for s in args.shards.split(",") if s.strip()]
    if not wanted or any(s not in shards for s in wanted):
        ap.error(f"--shards takes a subset of {', '.join(shards)}")
    args.sections = {s.strip() for s in args.sections.split(",") if s.strip()}
    if not args.sections or not args.sections <= set(SECTIONS):
        ap.error(f"--sections takes a subset of {', '.join(SECTIONS)}")
    if args.no_product and args.sections & {"publish", "memory"}:
        print(f"(--no-product: skipping {', '.join(sorted(args.sections & {'publish', 'memory'}))})")
        args.sections -= {"publish", "memory"}

    if "rdma" in args.sections and not rdma_available():
        print("(section rdma: NIXL is not installed; running local against memcpy only)")
    print(f"holder -> reader on 127.0.0.1, {args.size_mib} MiB shards, tcp streams {args.streams}, chunk "
          f"{ENGINE_CHUNK >> 20} MiB, {args.repeats} repeats (+{args.warmup} warm-up), seed {args.seed}, {os.cpu_count()} CPUs, "
          f"sections {','.join(s for s in SECTIONS if s in args.sections)}")  # fmt: skip
    server_proc = None
    server = None
    results: dict[str, Any] = {}
    pub = None
    rdma: dict[str, Any] = {}
    try:
        if not args.no_product and args.sections & {"plan", "transfer", "publish", "memory"}:
            server_proc, server = start_server(args.timeout, echo_all=False)
        with asyncio.Runner(loop_factory=new_event_loop) as runner, ThreadPoolExecutor(2) as pool:
            if args.sections & {"plan", "transfer", "verify", "memory"}:
                for label in wanted:
                    results[label] = bench_shard(label, shards[label], args, server, runner, pool)
        if "publish" in args.sections and server is not None:
            pub = bench_publish(args, server)
        if "rdma" in args.sections:
            for tls in [None, *([args.ucx_tls] if args.ucx_tls else [])]:
                if tls and not rdma_available():
                    continue
                rdma[tls or "default"] = bench_rdma(args, shards, wanted, tls)
    except BenchmarkError as err:
        print(f"FAILED: {err}", file=sys.stderr)
        return 1
    finally:
        if server_proc is not None:
            stop_process(server_proc)

    rep = Report()
    report_plan(results, rep)
    report_transfer(results, args, rep)
    if "verify" in args.sections:
        report_verify(results, rep)
    if pub is not None:
        report_publish(pub, rep)
    report_memory(results, rep)
    report_rdma(rdma, args, rep)
    print()
    if args.sections & {"plan", "transfer", "verify", "memory"}:
        print("all transfers verified: every tensor's CRC-32 matched the holder's")
    if rdma:
        print("all rdma pulls verified: every checksum unit's xxh3-64 matched the holder's")
    missed = [what for what, ok in rep.verdicts if not ok]
    print(f"goals: {len(rep.verdicts) - len(missed)} PASS, {len(missed)} MISS" + (f" ({'; '.join(missed)})" if missed else ""))
    if args.json:
        config = {k: (str(v) if isinstance(v, Path) else sorted(v) if isinstance(v, set) else v) for k, v in vars(args).items()}
        out = {"config": config, "goals": {"tcp_vs_baseline_min": GOAL_TCP, "verify_ratio_max": GOAL_VERIFY,
                                           "hash_vs_memcpy_min": GOAL_HASH, "publish_ratio_max": GOAL_PUBLISH,
                                           "rss_delta_mib_max": GOAL_RSS_MIB, "nixl_vs_raw_min": GOAL_NIXL,
                                           "local_vs_memcpy_min": GOAL_LOCAL},
               "verdicts": [{"goal": what, "met": ok} for what, ok in rep.verdicts],
               "shards": results, "publish": pub, "rdma": rdma or None}  # fmt: skip
        write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
