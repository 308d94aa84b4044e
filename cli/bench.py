"""`kvcache bench ...`: benchmarks of this machine's tiers (see kvcache.tiering.bench_tiers)."""

from __future__ import annotations

import argparse

TIERS_EPILOG = """what is measured, per block size (medians of --repeats runs, after a warm-up):
  dram get / put    BlockStore and DramTier vs memcpy of the same bytes
  nvme put          durable put_many (segment append + fdatasync + index commit)
                    vs write() of the same chunks with one fdatasync per batch
  nvme cold get     get_into after dropping the page cache (checksums verified)
                    vs pread() of the raw file after dropping its page cache
  also: hashing a 128k-token prompt (xxh3-128, sha256), and looking up 1,000
  blocks in a --index-blocks index (vs raw LMDB gets)

targets (reported, never enforced): dram get >= 0.8 x memcpy, nvme put >= 0.7 x raw
write, nvme cold get >= 0.7 x raw read. Ratios are throughput ratios (>1: faster).

examples:
  kvcache bench tiers
  kvcache bench tiers --sizes 64K,1M --total-mib 64 --index-blocks 100000
  kvcache bench tiers --data-dir /mnt/nvme0 --out-dir /tmp/results
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("bench", help="benchmark this machine's tiers",
                              description="Benchmarks of the store on this machine.")
    sub = p.add_subparsers(dest="bench_command", metavar="BENCHMARK", required=True)
    t = sub.add_parser("tiers", help="DRAM/NVMe throughput against memcpy and raw disk",
                       description="Throughput of the DRAM and NVMe tiers against memcpy and raw disk "
                                   "I/O, block-hash and lookup latency; writes a JSON report.",
                       formatter_class=argparse.RawDescriptionHelpFormatter, epilog=TIERS_EPILOG)
    _add_tiers_arguments(t)
    t.set_defaults(func=run_tiers)
    return p


def _add_tiers_arguments(p: argparse.ArgumentParser) -> None:
    from kvcache.tiering import bench_tiers
    bench_tiers.add_arguments(p)


def run_tiers(args: argparse.Namespace) -> int:
    from kvcache.tiering import bench_tiers
    doc = bench_tiers.run_from_args(args)
    return 0 if doc else 1
