"""`kvcache stats | check | gc`: maintenance verbs over a data directory."""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

from kvcache.cli.fmt import human_size, print_table
from kvcache.kvstore.config import StoreConfig
from kvcache.kvstore.index_usage import TENANT_BLOCKS, TENANT_BYTES
from kvcache.kvstore.types import UNKNOWN


def add_parsers(sub) -> None:
    fmt = argparse.RawDescriptionHelpFormatter
    p = sub.add_parser("stats", formatter_class=fmt, help="show what a data directory holds",
                       description="Show blocks, bytes, segments, counters and an idle-time histogram.\n"
                                   "Reads the index read-only, so it works while `kvcache serve` runs.")
    p.add_argument("data_dir", metavar="DIR", help="the store's data directory")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.add_argument("--quick", action="store_true", help="skip the per-block scan (no histogram)")
    p.add_argument("--config", metavar="FILE.toml",
                   help="the daemon's store config, for the tiers' capacities; default: built-in defaults")
    p.set_defaults(func=cmd_stats)

    p = sub.add_parser("check", formatter_class=fmt, help="verify and reconcile index and data",
                       description="Verify every indexed block (header, key, checksum), recount segment\n"
                                   "usage and find orphan or torn data. Exit status 1 if problems are found.\n"
                                   "With --fix: drop bad entries, rewrite the counts, register orphan segments\n"
                                   "for GC. With --rebuild: discard the index and rebuild it from the segments.")
    _store_args(p)
    p.add_argument("--fix", action="store_true", help="repair what was found")
    p.add_argument("--quick", action="store_true", help="verify headers only, not payload checksums")
    p.add_argument("--rebuild", action="store_true", help="rebuild the index from the NVMe segments")
    p.add_argument("--objects", action="store_true",
                   help="also re-read and verify every object-tier copy (one ranged GET per block: slow and "
                        "billed on S3); --fix forgets bad copies")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("gc", formatter_class=fmt, help="expire, evict and compact now",
                       description="Run garbage collection until a full pass is done: delete expired blocks,\n"
                                   "evict over the NVMe watermark, compact sparse segments. On a directory a\n"
                                   "running daemon holds, run it in the daemon: --url (POST /v1/gc, admin).")
    _store_args(p, optional=True)
    p.add_argument("--url", help="a running daemon (http://host:port or unix:///path.sock): GC runs in it")
    p.add_argument("--token", help="with --url: an admin bearer token (default: $KVCACHE_TOKEN)")
    p.add_argument("--max-steps", type=int, default=1_000_000, help="stop after this many bounded steps")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_gc)


def _store_args(p: argparse.ArgumentParser, optional: bool = False) -> None:
    p.add_argument("data_dir", metavar="DIR", nargs="?" if optional else None,
                   help="the store's data directory (must not be in use: a running daemon holds it)")
    p.add_argument("--config", metavar="FILE.toml",
                   help="store config (retention and NVMe settings); default: built-in defaults")


# what to do instead, per verb, when a daemon holds the directory
IN_USE_ADVICE = {
    "check": "check needs the directory to itself and the daemon has no live check route: stop the daemon "
             "(SIGTERM drains and flushes), run `kvcache check {dir}`, then start it again. Meanwhile "
             "`kvcache stats {dir}` reads it and `kvcache gc --url http://127.0.0.1:8790` collects in the daemon",
    "gc": "run GC in the daemon instead: `kvcache gc --url http://127.0.0.1:8790` (its address; POST /v1/gc "
          "with an admin token, --token or $KVCACHE_TOKEN), or stop the daemon first",
}


def refuse_if_in_use(data_dir: str, verb: str) -> None:
    """A clear refusal, before anything is touched, when a daemon (or any writer) holds the directory."""
    from kvcache.kvstore.errors import StoreLockedError
    from kvcache.kvstore.lockfile import lock_holder
    holder = lock_holder(data_dir)
    if holder is not None:
        raise StoreLockedError(f"data directory {data_dir} is in use by {holder} (a running `kvcache serve`?): "
                               + IN_USE_ADVICE[verb].format(dir=data_dir))


def open_offline_store(args):
    """The store without a DRAM tier (maintenance needs no arena), with its collector for puts' make_room."""
    from kvcache.gc.collector import Collector
    from kvcache.kvstore.store import BlockStore
    import os
    if not os.path.isdir(args.data_dir):
        raise FileNotFoundError(f"data directory {args.data_dir} does not exist")
    refuse_if_in_use(args.data_dir, args.command)
    cfg = StoreConfig.load(args.config, args.data_dir) if args.config else StoreConfig(args.data_dir)
    return BlockStore(dataclasses.replace(cfg, dram=None, write_policy="write-through", gc_interval_s=0),
                      maintenance=Collector)


def cmd_stats(args) -> int:
    from kvcache.kvstore.stats import offline_stats
    cfg = StoreConfig.load(args.config, args.data_dir) if args.config else None
    st = offline_stats(args.data_dir, time.time(), deep=not args.quick, config=cfg)
    if args.json:
        print(json.dumps(st.to_dict(), indent=2))
        return 0
    print_table(_stats_rows(st, args.quick))
    return 0


# persistent counter -> what a row says (tenant counters are per tenant: prefix + name)
COUNTER_LABELS = {"expired": "blocks expired", "evicted_nvme": "blocks evicted from NVMe",
                  "quarantined": "blocks quarantined (failed verification)"}
TENANT_LABELS = {TENANT_BLOCKS: "blocks of tenant", TENANT_BYTES: "payload bytes of tenant"}


def counter_label(name: str) -> str:
    for prefix, label in TENANT_LABELS.items():
        if name.startswith(prefix):
            return f"{label} {name[len(prefix):] or '(anonymous)'}"
    return COUNTER_LABELS.get(name, name.replace("_", " "))


def _stats_rows(st, quick: bool) -> list[tuple[str, str]]:
    """One table (one column width) in sections: the directory, the tiers, the totals, idle times."""
    rows = [("data directory", st.data_dir), ("blocks", f"{st.index_blocks:,}"),
            ("namespaces", f"{st.namespaces:,}"), ("segments", f"{st.segments:,}"),
            ("live bytes", human_size(st.live_bytes))]
    if not quick:
        rows.append(("pinned blocks", f"{st.pinned_blocks:,}"))
    rows.append(("", ""))
    for t in st.tiers:
        if t.blocks == UNKNOWN:      # offline: a daemon's DRAM holds what it holds
            rows.append((f"{t.tier} tier", f"{human_size(t.capacity_bytes)} configured (its blocks live in "
                                           "the daemon's memory: not read offline)"))
        else:
            rows.append((f"{t.tier} tier", f"{t.blocks:,} blocks, {human_size(t.used_bytes)} on disk "
                                           f"of {human_size(t.capacity_bytes)}"))
    if st.persistent_counters:
        rows += [("", ""), ("totals since the store was made", "")]
        rows += [(f"  {counter_label(k)}", human_size(v) if k.startswith(TENANT_BYTES) else f"{v:,}")
                 for k, v in sorted(st.persistent_counters.items())]
    if st.age_histogram:
        rows += [("", ""), ("idle time since last access", "")]
        rows += [(f"  {k}", f"{v:,} blocks") for k, v in st.age_histogram.items()]
    return rows


def cmd_check(args) -> int:
    import os
    import shutil
    from kvcache.gc.fsck import check
    if os.path.isdir(args.data_dir):     # before --rebuild moves a live daemon's index away
        refuse_if_in_use(args.data_dir, "check")
    if args.rebuild:
        idx = os.path.join(args.data_dir, "index")
        if os.path.isdir(idx):
            shutil.move(idx, idx + f".old-{int(time.time())}")
    with open_offline_store(args) as store:
        rep = check(store, fix=args.fix, deep=not args.quick, progress=not args.json, objects=args.objects)
    if args.json:
        print(json.dumps(rep.to_dict(), indent=2))
    else:
        print_table([("blocks checked", f"{rep.blocks_checked:,}"), ("bad blocks", len(rep.bad_blocks)),
                ("segment count mismatches", rep.segment_table_mismatches),
                ("orphan segments", len(rep.orphan_segments)), ("missing segments", len(rep.missing_segments)),
                ("corrupt records", rep.corrupt_records), ("torn bytes", human_size(rep.torn_bytes)),
                ("unreferenced bytes (GC reclaims)", human_size(rep.unreferenced_bytes))]
                + ([("object copies checked", f"{rep.objects_checked:,}"),
                    ("bad object copies", len(rep.bad_object_copies)),
                    ("object copies unverified (store unreachable)", rep.objects_unverified)] if args.objects else []))
        for key, why in list(rep.bad_blocks.items())[:20]:
            print(f"  bad {key}: {why}")
        for key, why in list(rep.bad_object_copies.items())[:20]:
            print(f"  bad object copy {key}: {why}")
        print("fixed." if rep.fixed else ("ok." if rep.ok else "problems found; run with --fix to repair."))
    return 0 if (rep.ok or rep.fixed) else 1


def cmd_gc(args) -> int:
    if args.url:
        rep = _gc_in_daemon(args)
    elif args.data_dir is None:
        raise ValueError("give a data directory, or --url for a running daemon")
    else:
        from kvcache.gc.collector import Collector
        with open_offline_store(args) as store:
            rep = dataclasses.asdict(Collector(store).run(args.max_steps))
    if args.json:
        print(json.dumps(rep, indent=2))
    else:
        print_table([(k.replace("_", " "), f"{v:,}" if isinstance(v, int) else v) for k, v in rep.items()])
    return 0


def _gc_in_daemon(args) -> dict:
    """POST /v1/gc: the daemon runs the steps (one GC report, as offline)."""
    from kvcache.client.open_store import open_store
    if args.data_dir is not None or args.config:
        raise ValueError("--url runs GC in the daemon, with its own directory and config: drop DIR and --config")
    # a full pass over a large store takes longer than a request's usual 30 s
    with open_store(args.url, token=args.token, timeout_s=3600.0, shared_memory="off") as client:
        return client.gc(args.max_steps)
