"""The store benchmarks' options (`kvcache bench tiers`, `daemon`, `lmcache`): each one's
arguments and epilog, for verbs.py's VERBS. Nothing here imports a benchmark module.
"""

from __future__ import annotations

import argparse

from kvcache.benchmarks.args import checked, names, parse_sizes

DEFAULT_OUT = "benchmarks/results"        # `kvcache bench`: under the current directory
TIERS_SIZES = "64K,128K,256K,1M,4M,32M"
DAEMON_SIZES = "64K,128K,256K,1M,4M,32M"

TIERS_EPILOG = """what is measured, per block size (medians of --repeats rounds, after a warm-up round):
  dram get / put    BlockStore (NVMe off) and DramTier vs memcpy of the same bytes
  nvme put          durable put_many (segment append + fdatasync + index commit), and
                    NvmeTier.put alone, vs write() of the same chunks + fdatasync per batch
  nvme cold get     get_into after dropping the page cache (checksums verified)
                    vs pread() of the raw file after dropping its page cache
  also: keying a 128k-token prompt (xxh3-128, sha256), and looking up 1,000 blocks
  in an index of --index-blocks entries (vs raw LMDB gets in one transaction)

targets (reported, never enforced; the worst block size counts): dram get >= 0.7 x memcpy,
dram get_many_into >= 0.8, dram put >= 0.7, nvme put >= 0.8 x raw write, nvme cold get >= 0.7
x raw read. Ratios are throughput ratios (>1: faster). Gets read into one buffer half a page
past a page boundary (baselines.dest_buffer says why that matters).
The JSON report goes to OUT_DIR/tier_throughput-<UTC time>.json and ...-latest.json.

examples:
  kvcache bench tiers
  kvcache bench tiers --sizes 64K,1M --total-mib 64 --index-blocks 100000
  kvcache bench tiers --data-dir /mnt/nvme0 --out-dir /tmp/results
"""


def add_tiers_arguments(p: argparse.ArgumentParser, default_out_dir: str = DEFAULT_OUT) -> None:
    count = checked(int, what="a positive integer")
    p.add_argument("--sizes", type=checked(parse_sizes, bool), default=parse_sizes(TIERS_SIZES),
                   metavar="LIST", help=f"comma-separated block sizes, K/M/G suffixes (default: {TIERS_SIZES})")
    p.add_argument("--total-mib", type=checked(float), default=256, metavar="MIB",
                   help="bytes moved per block size and operation, in MiB (default: 256)")
    p.add_argument("--repeats", type=count, default=3, metavar="N",
                   help="timed rounds per measurement; medians are reported (default: 3)")
    p.add_argument("--batch-mib", type=checked(float), default=16, metavar="MIB",
                   help="bytes per put_many call and per fdatasync of the baseline, in MiB (default: 16)")
    p.add_argument("--index-blocks", type=count, default=1_000_000, metavar="N",
                   help="entries in the index for the 1,000-block lookup (default: 1000000)")
    p.add_argument("--segment-mib", type=checked(float, lambda v: v >= 1, "at least 1 MiB"), default=None,
                   metavar="MIB", help="NVMe segment size (default: the NvmeConfig default, 256)")
    p.add_argument("--data-dir", default=None, metavar="DIR",
                   help="where NVMe and index files go: a scratch directory is made inside DIR and "
                        "removed afterwards (default: the current directory; pick the disk to measure)")
    p.add_argument("--out-dir", default=default_out_dir, metavar="DIR",
                   help=f"where the JSON reports go (default: {default_out_dir})")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


DAEMON_EPILOG = """what is measured, per block size (medians of --repeats rounds, after a warm-up round):
  put   daemon KVClient.put_many over HTTP and over its unix socket (durable: write-through,
        fsync "always"), and over HTTP to a second daemon in write-back mode (acknowledged
        from DRAM); redis-py pipelined SET over TCP and unix socket (memory only) and
        over TCP to a second redis with appendonly yes + appendfsync always; memcpy; and
        write() of the same blocks to a fresh file in the data dir + one fdatasync per batch
  get   daemon KVClient.get_many_into (HTTP, unix socket, shared memory; served from DRAM); pipelined GET
        + copy into the same buffer (TCP, unix socket); the same bytes over a bare loopback
        TCP socket (loopback tcp: the baseline of http_get_vs_loopback); memcpy of the same blocks out of
        where the daemon holds them (memcpy arena: the baseline of local_get_vs_memcpy) and
        out of the benchmark's own buffer (memcpy)
  restart  the same bytes put durably into a daemon of their own, read back after a restart
        (NVMe only) through shared memory with the segment files page-cached and after evicting
        them (posix_fadvise DONTNEED), and over HTTP; against pread of the segment files in
        block-size reads into one buffer (and pread + xxh3 of each read); --restart-rounds
  also: p50/p99 of a 1,000-block lookup through the daemon (HTTP), 1,000 keys present

targets (reported, never enforced; the worst block size counts): daemon_get_vs_redis >= 3,
daemon_put_vs_redis >= 1, local_get_vs_memcpy >= 0.9 (the shared-memory path),
nvme_get_after_restart_vs_pread >= 0.7 (page-cached), nvme_get_after_restart_cold_vs_pread >= 0.8.
Needs redis-server on PATH (apt-get install redis-server) and redis-py (pip install redis).

examples:
  kvcache bench daemon
  kvcache bench daemon --sizes 1M --total-mib 32 --repeats 1 --restart-rounds 0
"""


def add_daemon_arguments(p: argparse.ArgumentParser, default_out_dir: str = DEFAULT_OUT) -> None:
    count = checked(int, what="a positive integer")
    p.add_argument("--sizes", type=checked(parse_sizes, bool), default=parse_sizes(DAEMON_SIZES), metavar="LIST",
                   help=f"comma-separated block sizes, K/M/G suffixes (default: {DAEMON_SIZES})")
    p.add_argument("--total-mib", type=checked(float), default=128, metavar="MIB",
                   help="bytes per block size, operation and side, in MiB (default: 128)")
    p.add_argument("--repeats", type=count, default=5, metavar="N",
                   help="timed rounds; medians are reported (default: 5)")
    p.add_argument("--batch-mib", type=checked(float), default=16, metavar="MIB",
                   help="bytes per put_many / get_many_into call and per redis pipeline (default: 16)")
    p.add_argument("--lookup-runs", type=count, default=200, metavar="N", help="timed lookups (default: 200)")
    p.add_argument("--restart-rounds", type=checked(int, lambda v: v >= 0, "0 or more"), default=3, metavar="N",
                   help="rounds of the read-after-restart phase, each restarting the daemon three times; "
                        "medians are reported; 0 skips it (default: 3)")
    p.add_argument("--redis-server", default="redis-server", metavar="PATH", help="the redis-server binary")
    p.add_argument("--no-redis-durable", action="store_true", help="skip the appendfsync-always redis")
    p.add_argument("--data-dir", default=None, metavar="DIR",
                   help="where the daemon's data, redis' AOF and the raw file go: a scratch directory inside DIR, "
                        "removed afterwards (default: the current directory; pick the disk to measure)")
    p.add_argument("--out-dir", default=default_out_dir, metavar="DIR",
                   help=f"where the JSON reports go (default: {default_out_dir})")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


LMCACHE_EPILOG = """what is measured, per request shape (--requests requests each, medians):
  mla   15 chunks of 17.2 MiB (256 tokens x 61 layers x 576 x bf16), 257 MiB a request
  mha   8 chunks of 32 MiB (256 tokens x 32 layers x K,V x 8 heads x 128 x fp16), 256 MiB
  store, warm lookup + retrieve, then both servers restarted: lookup + retrieve from disk only.
  LMCache: `lmcache server --shm-name ... --l2-adapter fs` and its own `lmcache bench server
  --mode cpu` (its [seq N/...] timings); kvcache: `kvcache serve` (NVMe fsync "always") and
  KVClient over shared memory, one block per chunk, into one request-sized buffer.
  speedup = LMCache ms / kvcache ms (> 1: the daemon is faster).

LMCache is found on PATH, in $KVCACHE_LMCACHE, or at --lmcache; without it the benchmark exits 2
with how to install it (its CPU-only install: benchmarks/README.md).

examples:
  kvcache bench lmcache --lmcache /opt/lmcache-venv/bin/lmcache
  kvcache bench lmcache --shapes mla --requests 1
"""


def add_lmcache_arguments(p: argparse.ArgumentParser, default_out_dir: str = DEFAULT_OUT) -> None:
    p.add_argument("--lmcache", default=None, metavar="PATH",
                   help="the lmcache executable (default: $KVCACHE_LMCACHE, else `lmcache` on PATH)")
    p.add_argument("--shapes", type=checked(names, lambda v: bool(v) and set(v) <= {"mla", "mha"}, "mla and/or mha"),
                   default=["mla", "mha"], metavar="LIST", help="request shapes: mla, mha (default: both)")
    p.add_argument("--requests", type=checked(int, what="a positive integer"), default=3, metavar="N",
                   help="requests per shape, each its own keys (default: 3)")
    p.add_argument("--data-dir", default=None, metavar="DIR",
                   help="where both servers keep their data: a scratch directory inside DIR, removed afterwards "
                        "(default: the current directory)")
    p.add_argument("--out-dir", default=default_out_dir, metavar="DIR",
                   help=f"where the JSON report goes (default: {default_out_dir})")


VLLM_EPILOG = """what is measured (each engine its own process, `kvcache serve` another):
  TTFT of a long prefix plus a short suffix, cold (vLLM, prefix caching off), warm from vLLM's own
  prefix cache, and warm from the daemon through the connector (prefix caching off: a new process
  would see the same); the connector's load throughput against the daemon's own get_many_into of
  blocks of the same size.

targets (reported, never enforced): vllm_warm_ttft_vs_cold <= 0.3 for a prefix of several
thousand tokens, connector_load_vs_daemon_get >= 0.8.

vLLM runs in a Python that has it: this one, --vllm-python or $KVCACHE_VLLM_PYTHON (on a CPU-only
machine the [vllm] extra, in a venv of its own: README). Without one the benchmark exits 2.

examples:
  kvcache bench vllm --vllm-python /opt/vllm-venv/bin/python
  kvcache bench vllm --prefix-tokens 2048 --repeats 2 --layers 4
"""


def add_vllm_arguments(p: argparse.ArgumentParser, default_out_dir: str = DEFAULT_OUT) -> None:
    p.add_argument("--prefix-tokens", type=checked(int, lambda v: v >= 256, "at least 256"), default=4096,
                   metavar="N", help="tokens of the repeated prefix (default 4096)")
    p.add_argument("--repeats", type=checked(int, what="a positive integer"), default=6, metavar="N",
                   help="warm prompts after the first, each with another suffix (default 6; the load rate "
                        "is the median of all but the first warm one)")
    p.add_argument("--layers", type=checked(int, what="a positive integer"), default=8, metavar="N",
                   help="layers of the random-weight Llama (default 8: prefill costs seconds on 2 cores)")
    p.add_argument("--vllm-python", default=None, metavar="PATH",
                   help="a python with vLLM (default: $KVCACHE_VLLM_PYTHON, else this one)")
    p.add_argument("--data-dir", default=None, metavar="DIR",
                   help="where the model, the daemon's data and the logs go: a scratch directory inside DIR, "
                        "removed afterwards (default: the system's temporary directory)")
    p.add_argument("--out-dir", default=default_out_dir, metavar="DIR",
                   help=f"where the JSON report goes (default: {default_out_dir})")
