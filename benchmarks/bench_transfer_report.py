"""The report of ``bench_transfer.py``: its goals, and a table per section printed from the
results, with PASS or MISS for every goal met or missed (the derived figures, medians and
ratios, are added to the results as they are printed, for ``--json``)."""

from __future__ import annotations

import argparse
from typing import Any

from benchmarks.bench_transfer_baselines import RAW_INFLIGHT
from benchmarks.bench_transfer_rdma import RDMA_READERS
from benchmarks.harness import median, verdict
from benchmarks.harness.shards import ENGINE_CHUNK, MEMORY_SHARD
from tensorhub.transports.buffers import DEFAULT_PACK_THRESHOLD

GOAL_TCP = 0.9  # tcp / baseline, GB/s
GOAL_VERIFY = 1.10  # tcp+verify / tcp, seconds
GOAL_HASH = 1.0  # hash / memcpy, GB/s (one thread each)
GOAL_PUBLISH = 1.5  # publish median at the largest size / at the smallest
GOAL_RSS_MIB = 64.0  # peak RSS - RSS after register, each side
GOAL_NIXL = 0.9  # nixl / raw NIXL READ, GB/s
GOAL_LOCAL = 0.7  # local / one-thread memcpy, GB/s, one reader


class Report:
    """Prints figures with their goals and keeps every verdict."""

    def __init__(self) -> None:
        self.verdicts: list[tuple[str, bool]] = []

    def goal(self, what: str, ok: bool) -> str:
        self.verdicts.append((what, ok))
        return verdict(ok)


def report_plan(results: dict[str, Any], rep: Report) -> None:
    rows = [(label, res["plan"]) for label, res in results.items() if "plan" in res]
    if not rows:
        return
    rb = rows[0][1]["on"]["read_bytes"]
    print(f"\n1. registrations and transfer operations per pull ({rb >> 20} MiB reads; large = tensors of at least "
          f"{DEFAULT_PACK_THRESHOLD >> 20} MiB; goal with packing: regions <= large + packs, reads and segments <= "
          f"large + packs + shard/read size)")  # fmt: skip
    print(f"{'shard':<10} {'packing':<12} {'tensors':>7} {'large':>5} {'packs':>5} {'packed MiB':>10} {'regions':>7} "
          f"{'reads':>5} {'segments':>8}  {'goal':<20} {'':4}  product last_pull (reads/segments/regions)")  # fmt: skip
    for label, plan in rows:
        for key, name in (("on", f"on (< {DEFAULT_PACK_THRESHOLD >> 20} MiB)"), ("off", "off (0)")):
            p = plan[key]
            if key == "on":
                met = p["regions"] <= p["goal_regions_max"] and max(p["reads"], p["segments"]) <= p["goal_ops_max"]
                goal = f"<= {p['goal_regions_max']}, <= {p['goal_ops_max']}"
                mark = rep.goal(f"{label} regions, reads and segments with packing", met)
            else:
                goal, mark = "(reference)", "-"
            stats = p.get("product_last_pull")
            if stats is None:
                agree = "(product path not run)"
            else:
                same = (stats["reads"], stats["segments"], stats["regions"]) == (p["reads"], p["segments"], p["regions"])
                agree = (f"{stats['reads']}/{stats['segments']}/{stats['regions']}: "
                         f"{'agrees' if same else 'DIFFERS'}, {rep.goal(f'{label} {key} plan vs last_pull', same)}")  # fmt: skip
            print(f"{label:<10} {name:<12} {p['tensors']:>7} {p['large_tensors']:>5} {p['packs']:>5} "
                  f"{p['pack_bytes'] / 2**20:>10.1f} {p['regions']:>7} {p['reads']:>5} {p['segments']:>8}  {goal:<20} "
                  f"{mark:4}  {agree}")  # fmt: skip
        on, off = plan["on"], plan["off"]
        print(f"{'':<10} packing: {off['regions'] / on['regions']:.1f}x fewer regions, "
              f"{off['segments'] / on['segments']:.1f}x fewer segments, {off['reads'] / on['reads']:.2f}x the reads")  # fmt: skip


def report_transfer(results: dict[str, Any], args: argparse.Namespace, rep: Report) -> None:
    rows = [(label, res) for label, res in results.items() if "seconds" in res]
    if not rows:
        return
    print(f"\n2. one pull, holder -> reader on 127.0.0.1 (goal: tcp >= {GOAL_TCP:.2f} x baseline)")
    print(f"{'shard':<10} {'path':<34} {'GB/s median':>11} {'min':>7} {'max':>7} {'vs baseline':>11} {'paired':>7} "
          f"{'CPU s/GB':>8}  goal")  # fmt: skip
    describe = {"baseline": "baseline (raw socket, 1 conn)", "tcp": f"tcp transport ({args.streams} streams)",
                "tcp+verify": f"tcp + verify ({args.streams} streams)",
                "tcp unpacked": f"tcp, no packing ({args.streams} streams)",
                "product": "product (server+publish+replicate)"}  # fmt: skip
    for label, res in rows:
        nbytes = res["bytes"]
        secs = res["seconds"]
        rates = {k: [nbytes / s / 1e9 for s in v] for k, v in secs.items()}
        med = {k: nbytes / median(v) / 1e9 for k, v in secs.items()}
        res["gbps"] = {k: sorted(v) for k, v in rates.items()}
        res["gbps_median"] = med
        res["ratio_to_baseline"] = {k: med[k] / med["baseline"] for k in med}
        # Paired: each repeat's ratio to the baseline of the same repeat (steadier on a noisy host).
        res["paired_ratio_median"] = {k: median([b / t for t, b in zip(res["seconds_by_repeat"][k], res["seconds_by_repeat"]["baseline"], strict=True)])
                                      for k in secs}  # fmt: skip
        res["cpu_s_per_gb_median"] = {k: median(v) / (nbytes / 1e9) for k, v in res["cpu_seconds_by_repeat"].items()}
        for k in secs:
            ratio = res["ratio_to_baseline"][k]
            note = "-"
            if k == "tcp":
                met = ratio >= GOAL_TCP
                res["goal_tcp_met"] = met
                note = f">= {GOAL_TCP:.2f}: {rep.goal(f'{label} tcp vs baseline', met)}"
            print(f"{label:<10} {describe[k]:<34} {med[k]:>11.2f} {min(rates[k]):>7.2f} {max(rates[k]):>7.2f} "
                  f"{ratio:>10.2f}x {res['paired_ratio_median'][k]:>6.2f}x {res['cpu_s_per_gb_median'][k]:>8.3f}  {note}")
        pulls = res.get("tcp_pulls", {}).get("tcp")
        if pulls:
            # Where a tcp pull's time goes: the reads, then the unpack (serial, after the last read).
            landed, unpack = median([p["landed_s"] for p in pulls]), median([p["unpack_s"] for p in pulls])
            res["tcp_landed_s_median"], res["tcp_unpack_s_median"] = landed, unpack
            print(f"{'':<10} (tcp: {pulls[0]['reads']} reads, {pulls[0]['segments']} segments per pull; last read landed "
                  f"after {landed * 1e3:.1f} ms = {median(secs['baseline']) / landed:.2f}x baseline's speed; then unpack "
                  f"{unpack * 1e3:.1f} ms = {unpack / median(secs['tcp']):.0%} of the pull)")  # fmt: skip
        if "trainer_publish_s" in res:
            print(f"{'':<10} (trainer: open+register {res['trainer_open_register_s'] * 1e3:.1f} ms, publish {res['trainer_publish_s'] * 1e3:.1f} ms)")
    if args.size_mib != 1024:
        print(f"(the goals are stated for 1 GiB shards; this run used {args.size_mib} MiB)")


def report_verify(results: dict[str, Any], rep: Report) -> None:
    rows = [(label, res) for label, res in results.items() if "tcp+verify" in res.get("seconds", {})]
    if not rows:
        return
    print(f"\n3. what verification adds to a tcp pull (goal: tcp+verify / tcp <= {GOAL_VERIFY:.2f} in time)")
    print(f"{'shard':<10} {'tcp ms':>7} {'+verify':>7} {'ratio':>6} {'paired':>6} {'landed ms':>13} {'tail ms':>7} "
          f"{'hashing ms':>10} {'1-thread hash ms':>16} {'CPU s/GB':>13}  goal")  # fmt: skip
    for label, res in rows:
        t, tv = median(res["seconds"]["tcp"]), median(res["seconds"]["tcp+verify"])
        paired = median([b / a for a, b in zip(res["seconds_by_repeat"]["tcp"], res["seconds_by_repeat"]["tcp+verify"], strict=True)])
        plain, checked = res["tcp_pulls"]["tcp"], res["tcp_pulls"]["tcp+verify"]
        landed = median([p["landed_s"] for p in plain]), median([p["landed_s"] for p in checked])
        tail = median([p["verified_s"] - p["landed_s"] for p in checked])  # hashing left after the last read
        hashing = median([p["verify_s"] for p in checked])  # summed over the hashing threads
        alone = median(res["single_thread_s"]["hash_shard_s"])
        cpu = res["cpu_s_per_gb_median"]
        res.update(verify_ratio=tv / t, verify_ratio_paired=paired, verify_landed_s=landed, verify_tail_s=tail,
                   verify_thread_s=hashing)  # fmt: skip
        met = tv / t <= GOAL_VERIFY
        print(f"{label:<10} {t * 1e3:>7.1f} {tv * 1e3:>7.1f} {tv / t:>5.2f}x {paired:>5.2f}x "
              f"{landed[0] * 1e3:>6.1f}->{landed[1] * 1e3:<6.1f} {tail * 1e3:>7.1f} {hashing * 1e3:>10.1f} "
              f"{alone * 1e3:>7.1f} ({alone / t:>4.0%}) {cpu['tcp']:>6.3f}->{cpu['tcp+verify']:<6.3f}  "
              f"<= {GOAL_VERIFY:.2f}: {rep.goal(f'{label} verify overhead', met)}")  # fmt: skip
    print("(landed: when the last read landed, tcp -> tcp+verify; tail: hashing still to do after it; hashing: time "
          "in the hashing threads, summed; 1-thread hash: checksum.compute of the whole shard alone, and its share "
          "of the tcp pull: what verification adds where no core is spare)")  # fmt: skip
    print(f"one thread, interleaved rounds over each shard's bytes (goal: the shard's hash >= {GOAL_HASH:.1f} x the faster "
          "memcpy)")  # fmt: skip
    print(f"{'shard':<10} {'hash of the shard':>17} {'xxh3, 1 buffer':>14} {'memcpy torch':>12} {'memcpy memoryview':>17} "
          f"{'hash/memcpy':>11}  goal")  # fmt: skip
    for label, res in rows:
        gbps = {k.removesuffix("_s"): res["bytes"] / median(v) / 1e9 for k, v in res["single_thread_s"].items()}
        ratio = gbps["hash_shard"] / max(gbps["memcpy_torch"], gbps["memcpy_memoryview"])
        res["single_thread_gbps_median"], res["hash_vs_memcpy"] = gbps, ratio
        print(f"{label:<10} {gbps['hash_shard']:>12.2f} GB/s {gbps['xxh3_buffer']:>9.2f} GB/s {gbps['memcpy_torch']:>7.2f} GB/s "
              f"{gbps['memcpy_memoryview']:>12.2f} GB/s {ratio:>10.2f}x  {rep.goal(f'{label} hash vs memcpy', ratio >= GOAL_HASH)}")


def report_publish(pub: dict[str, Any], rep: Report) -> None:
    print(f"\n4. the trainer's publish(v) (goal: median at the largest size <= {GOAL_PUBLISH:.1f} x at the smallest)")
    print(f"{'shard MiB':>9} {'tensors':>7} {'publish ms median':>17} {'max':>7} {'declared ms median':>18} {'job GB/s':>8}")
    for p in pub.values():
        p["publish_ms_median"] = median(p["publish_s"]) * 1e3
        p["declared_ms_median"] = median(p["declared_s"]) * 1e3
        print(f"{p['bytes'] / 2**20:>9,.1f} {p['tensors']:>7} {p['publish_ms_median']:>17.2f} {max(p['publish_s']) * 1e3:>7.2f} "
              f"{p['declared_ms_median']:>18.1f} {p['bytes'] / median(p['declared_s']) / 1e9:>8.2f}")  # fmt: skip
    keys = list(pub)
    lo, hi = pub[keys[0]], pub[keys[-1]]
    ratio = hi["publish_ms_median"] / lo["publish_ms_median"]
    dratio = hi["declared_ms_median"] / lo["declared_ms_median"]
    pub_summary = {"publish_ratio": ratio, "declared_ratio": dratio}
    pub["summary"] = pub_summary
    print(f"largest/smallest ({hi['bytes'] / 2**20:,.1f}/{lo['bytes'] / 2**20:,.1f} MiB): publish {ratio:.2f}x  goal <= {GOAL_PUBLISH:.1f}: "
          f"{rep.goal('publish independent of size', ratio <= GOAL_PUBLISH)}; declared {dratio:.1f}x (no goal: "
          f"the background job reads every byte)")  # fmt: skip


def report_memory(results: dict[str, Any], rep: Report) -> None:
    mem = results.get(MEMORY_SHARD, {}).get("memory")
    if mem is None:
        return
    mib = 2**20
    print(f"\n5. resident memory of a pull, {MEMORY_SHARD} (goal: peak - RSS after register <= {GOAL_RSS_MIB:.0f} MiB each)")
    print(f"{'process':<8} {'after register MiB':>18} {'peak MiB':>9} {'peak - after MiB':>16}  {'method':<23} goal")
    for side in ("holder", "reader"):
        m = mem[side]
        m["delta"] = m["peak"] - m["rss_after_register"]
        met = m["delta"] / mib <= GOAL_RSS_MIB
        print(f"{side:<8} {m['rss_after_register'] / mib:>18.1f} {m['peak'] / mib:>9.1f} {m['delta'] / mib:>16.1f}  "
              f"{m['method']:<23} {rep.goal(f'{side} RSS', met)}")  # fmt: skip
    r, h = mem["reader"], mem["holder"]
    print(f"(not in the goal: register itself took {(h['rss_after_register'] - h['rss_before_register']) / mib:.1f} MiB "
          f"in the holder, {(r['rss_after_register'] - r['rss_before_register']) / mib:.1f} MiB in the reader: mostly "
          f"the pack buffers, a second copy of the packed tensors. Holder window: register, the publish job and every "
          f"pull it served; reader window: one replicate, {r['pull_s']:.2f} s)")  # fmt: skip


RDMA_DESCRIBE = {"raw nixl": f"raw NIXL READ ({RAW_INFLIGHT} in flight)", "nixl": "nixl transport",
                 "rdma_copy": "rdma_copy transport", "memcpy": "memcpy (torch, 1 thread)",
                 "local": "local transport"}  # fmt: skip


def report_rdma(rdma: dict[str, Any], args: argparse.Namespace, rep: Report) -> None:
    for run in rdma.values():
        env = f"UCX_TLS={run['ucx_tls']}" if run["ucx_tls"] else "UCX default transports"
        print(f"\n6. one holder process -> {', '.join(map(str, RDMA_READERS))} reader processes, each pulling the whole "
              f"shard [{env}]: the engine's read plan ({ENGINE_CHUNK >> 20} MiB reads), the transport's streams in "
              f"flight; each transport in its own phase with its baseline (goals: nixl >= {GOAL_NIXL:.2f} x raw NIXL "
              f"READ; local >= {GOAL_LOCAL:.2f} x memcpy with one reader)")  # fmt: skip
        print(f"{'shard':<10} {'readers':>7} {'path':<27} {'GB/s total':>10} {'per reader':>10} {'min':>6} {'max':>6} "
              f"{'vs baseline':>11} {'paired':>7} {'CPU s/GB':>8} {'idle cores':>10}  goal")  # fmt: skip
        for label, res in run["shards"].items():
            for path, phase in res["phases"].items():
                base = phase["baseline"]
                for k, kres in phase["by_readers"].items():
                    moved = int(k) * res["bytes"]
                    secs = kres["seconds_by_repeat"]
                    rates = {p: sorted(moved / s / 1e9 for s in v) for p, v in secs.items()}
                    med = {p: moved / median(v) / 1e9 for p, v in secs.items()}
                    cpu = {p: median(v) / (moved / 1e9) for p, v in kres["cpu_seconds_by_repeat"].items()}
                    ratio = med[path] / med[base]
                    paired = median([b / t for t, b in zip(secs[path], secs[base], strict=True)])
                    kres.update(gbps=rates, gbps_median=med, cpu_s_per_gb_median=cpu, ratio_to_baseline=ratio,
                                paired_ratio_median=paired)  # fmt: skip
                    note = "(no goal)"
                    readers = f"{k} reader{'s' if k != '1' else ''}"
                    if path == "nixl":
                        met = kres["goal_met"] = ratio >= GOAL_NIXL
                        note = f">= {GOAL_NIXL:.2f}: {rep.goal(f'{label} {readers} nixl vs raw NIXL ({env})', met)}"
                    elif path == "local" and k == "1":
                        met = kres["goal_met"] = ratio >= GOAL_LOCAL
                        note = f">= {GOAL_LOCAL:.2f}: {rep.goal(f'{label} local vs memcpy, one reader', met)}"
                    for p, vs, goal in ((base, f"{'(baseline)':>11} {'':>7}", "-"),
                                        (path, f"{ratio:>10.2f}x {paired:>6.2f}x", note)):  # fmt: skip
                        print(f"{label:<10} {k:>7} {RDMA_DESCRIBE[p]:<27} {med[p]:>10.2f} {med[p] / int(k):>10.2f} "
                              f"{rates[p][0]:>6.2f} {rates[p][-1]:>6.2f} {vs} {cpu[p]:>8.3f} {kres['idle_cores'][p]:>10.2f}  {goal}")  # fmt: skip
            print(f"{'':<10} ({res['reads_per_pull']} reads, {res['segments_per_pull']} segments per pull)")
        print("(GB/s total: bytes of all readers / from the first start to the last end; paired: median of each round's "
              "ratio; CPU s/GB: holder + readers, all threads; idle cores: what the holder and the readers burn with "
              "nothing to do, that path's agents up and connected: NIXL progress threads)")  # fmt: skip
        print(f"registration, not in the GB/s above (ms, median): expose() of the shard on each transport, raw: NIXL "
              f"register_memory of the same regions; first: right after the agent started (once per phase and reader "
              f"count); again: withdraw + expose {args.repeats} times; start(): the agent (rdma_copy registers its staging "
              f"pool there, never the shard)")  # fmt: skip
        print(f"{'shard':<10} {'what':<26} {'holder first':>12} {'holder again':>12} {'readers first':>13} "
              f"{'holder start()':>14} {'readers start()':>15}")  # fmt: skip
        for label, res in run["shards"].items():
            res["registration_ms_median"] = {}
            for name, reg in res["registration"].items():
                ms = {key: median(v) * 1e3 for key, v in reg.items() if v}
                res["registration_ms_median"][name] = ms
                what = "raw NIXL register_memory" if name == "raw nixl" else f"{name} expose()"
                cells = [f"{ms[key]:>{w}.2f}" if key in ms else f"{'-':>{w}}" for key, w in
                         (("holder_expose_s", 12), ("holder_again_s", 12), ("readers_expose_s", 13),
                          ("holder_start_s", 14), ("readers_start_s", 15))]  # fmt: skip
                print(f"{label:<10} {what:<26} {' '.join(cells)}")
    if rdma and args.size_mib != 1024:
        print(f"(the rdma goals are stated for 1 GiB shards; this run used {args.size_mib} MiB)")
