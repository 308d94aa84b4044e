"""Tier throughput benchmark: the DRAM and NVMe tiers against memcpy and raw disk I/O.

For each block size, over the same bytes and in the same run (repeats interleaved):

    DRAM get   BlockStore.get_into / DramTier.get_into  vs  memcpy into the same out buffer
    DRAM put   BlockStore.put_many / DramTier.put       vs  memcpy into a preallocated region
    NVMe put   BlockStore.put_many, fsync "always"      vs  write() of the same chunks, one
               (segment append + fdatasync + LMDB commit)   fdatasync per batch
    NVMe get   BlockStore.get_into after dropping the   vs  pread() of the raw file after
               page cache (checksum verified)               dropping its page cache

plus hashing a 128k-token prompt and a 1,000-block lookup in a 1M-block index. Ratios are
throughput ratios (>1: faster than the baseline); the top-level ratios are BlockStore's,
worst case over sizes. Targets are reported, never enforced. Medians of `repeats` runs,
after one warm-up round; buffers are allocated once and reused.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import xxhash
from tqdm import tqdm

from kvcache import __version__
from kvcache.kvstore.config import StoreConfig
from kvcache.kvstore.hashing import HashAlgo, Namespace, hash_blocks
from kvcache.kvstore.index import Index
from kvcache.kvstore.store import BlockStore, PutItem
from kvcache.kvstore.types import BlockMeta, Tier, raw_layout
from kvcache.tiering.base import BlockWrite
from kvcache.tiering.dram import DramConfig, DramTier
from kvcache.tiering.nvme import NvmeConfig, NvmeTier
from kvcache.tiering.slab import SlabAllocator

TARGETS = {"dram_get_vs_memcpy": 0.8, "nvme_put_vs_raw_write": 0.7, "nvme_get_vs_raw_read": 0.7}
DEFAULT_SIZES = "64K,256K,1M,4M"
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_NS = Namespace("bench-model@v0", "raw/bench", 256, name="bench")
_PROMPT_TOKENS, _LOOKUP_BLOCKS = 128 * 1024, 1000


def parse_size(text: str) -> int:
    """'64K' -> 65536; accepts K, M, G suffixes (binary) and an optional trailing 'iB'/'B'."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = t[-1:] if t[-1:] in ("K", "M", "G") else ""
    try:
        n = int(float(t[: len(t) - len(unit)]) * _UNITS[unit])
    except ValueError:
        raise ValueError(f"not a size: {text!r} (use e.g. 64K, 1M, 4M)") from None
    if n <= 0:
        raise ValueError(f"size must be positive, got {text!r}")
    return n


def parse_sizes(text: str) -> list[int]:
    return [parse_size(s) for s in text.split(",") if s.strip()]


def size_label(n: int) -> str:
    for unit in ("G", "M", "K"):
        if n % _UNITS[unit] == 0:
            return f"{n // _UNITS[unit]}{unit}"
    return str(n)


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


# ---------------------------------------------------------------- workload
@dataclass
class Workload:
    size: int
    blocks: list[memoryview]          # views into one shared urandom buffer
    keys: list[bytes]
    batches: list[tuple[int, int]]    # [start, stop) block index ranges

    @property
    def nbytes(self) -> int:
        return self.size * len(self.blocks)

    def items(self) -> list[list[PutItem]]:
        return [[PutItem(self.keys[i], self.blocks[i], _NS.id) for i in range(a, b)] for a, b in self.batches]

    def writes(self) -> list[list[BlockWrite]]:
        layout = raw_layout(self.size)
        return [[BlockWrite(self.keys[i], _NS.id, self.blocks[i], layout, 0.0) for i in range(a, b)]
                for a, b in self.batches]


def make_workload(source: memoryview, size: int, total_bytes: int, batch_bytes: int) -> Workload:
    n = max(1, total_bytes // size)
    per_batch = max(1, batch_bytes // size)
    blocks = [source[i * size: (i + 1) * size] for i in range(n)]
    keys = [xxhash.xxh3_128_digest(f"bench:{size}:{i}".encode()) for i in range(n)]
    return Workload(size, blocks, keys, [(a, min(n, a + per_batch)) for a in range(0, n, per_batch)])


def _rounds(ops: dict[str, Callable[[], float]], repeats: int, bar) -> dict[str, list[float]]:
    """One warm-up round, then `repeats` rounds; each op returns the seconds it measured.
    Odd rounds run the ops in reverse order so slow drift does not favour one side."""
    times: dict[str, list[float]] = {name: [] for name in ops}
    order = list(ops)
    for r in range(repeats + 1):
        for name in (order if r % 2 == 0 else order[::-1]):
            t = ops[name]()
            if r:
                times[name].append(t)
        bar.update(1)
    return times


# ---------------------------------------------------------------- DRAM
def _dram_config(size: int, n: int) -> DramConfig:
    """An arena that holds all n blocks below the high watermark (no eviction while timing)."""
    page = max(size, 16 << 20)
    chunk = SlabAllocator(page, page).chunk_size(size)
    pages = -(-n // (page // chunk))
    cap = max(pages * page, int(n * chunk / 0.9)) + 2 * page
    return DramConfig(capacity_bytes=cap, page_bytes=page, pin_memory="off")


def _timed_loop(fn, args) -> float:
    t0 = time.perf_counter()
    for a in args:
        fn(a)
    return time.perf_counter() - t0


def _memcpy_get(w: Workload, out: memoryview) -> float:
    dst = out[: w.size]
    t0 = time.perf_counter()
    for b in w.blocks:
        dst[:] = b
    return time.perf_counter() - t0


def _memcpy_put(w: Workload, region: memoryview) -> float:
    t0 = time.perf_counter()
    for i, b in enumerate(w.blocks):
        region[i * w.size: (i + 1) * w.size] = b
    return time.perf_counter() - t0


def _checked_get(get, w: Workload, out) -> float:
    t0 = time.perf_counter()
    for k in w.keys:
        if get(k, out) != w.size:
            raise RuntimeError(f"benchmark block {k.hex()} ({w.size} bytes) missing from the store")
    return time.perf_counter() - t0


def _tier_put(tier: DramTier, w: Workload, writes) -> float:
    for k in w.keys:
        tier.delete(k)
    return _timed_loop(tier.put, writes)


def _store_put(store: BlockStore, w: Workload, items) -> float:
    store.delete(w.keys)
    return _timed_loop(store.put_many, items)


def bench_dram(w: Workload, out: memoryview, region: memoryview, root: str, repeats: int, bar) -> dict:
    cfg = _dram_config(w.size, len(w.blocks))
    tier = DramTier(cfg)
    store = BlockStore(StoreConfig(os.path.join(root, "dram-store"), dram=cfg, nvme=None))
    store.register_namespace(_NS)
    items, writes = w.items(), w.writes()
    try:
        times = _rounds({
            "memcpy_put": lambda: _memcpy_put(w, region),
            "tier_put": lambda: _tier_put(tier, w, writes),
            "store_put": lambda: _store_put(store, w, items),
            "memcpy_get": lambda: _memcpy_get(w, out),
            "tier_get": lambda: _checked_get(lambda k, o: tier.get_into(k, None, o), w, out),
            "store_get": lambda: _checked_get(store.get_into, w, out),
        }, repeats, bar)
    finally:
        store.close()
        tier.close()
        shutil.rmtree(os.path.join(root, "dram-store"), ignore_errors=True)
    return {name: _gbps(w.nbytes, _median(t)) for name, t in times.items()}


# ---------------------------------------------------------------- NVMe
def _write_all(fd: int, data: memoryview) -> None:
    while data.nbytes:
        data = data[os.write(fd, data):]


def _drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _raw_round(w: Workload, out: memoryview, path: str) -> tuple[float, float]:
    """Raw baseline: same chunks, same batch boundaries, fdatasync per batch; then cold preads."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        t0 = time.perf_counter()
        for a, b in w.batches:
            for i in range(a, b):
                _write_all(fd, w.blocks[i])
            os.fdatasync(fd)
        put_s = time.perf_counter() - t0
    finally:
        os.close(fd)
    _drop_cache(path)
    fd, dst = os.open(path, os.O_RDONLY), out[: w.size]
    try:
        t0 = time.perf_counter()
        for i in range(len(w.blocks)):
            if os.preadv(fd, [dst], i * w.size) != w.size:
                raise RuntimeError(f"short read from {path}")
        get_s = time.perf_counter() - t0
    finally:
        os.close(fd)
        os.unlink(path)
    return put_s, get_s


def _store_round(w: Workload, items, out: memoryview, path: str, nvme: NvmeConfig) -> tuple[float, float]:
    """BlockStore with DRAM off: durable put_many per batch, then cold get_into of every block."""
    store = BlockStore(StoreConfig(path, dram=None, nvme=nvme))
    try:
        store.register_namespace(_NS)
        put_s = _timed_loop(store.put_many, items)
        store.nvme.drop_page_cache()
        get_s = _checked_get(store.get_into, w, out)
    finally:
        store.close()
        shutil.rmtree(path, ignore_errors=True)
    return put_s, get_s


def _tier_round(w: Workload, writes, out: memoryview, path: str, nvme: NvmeConfig) -> tuple[float, float]:
    """NvmeTier alone (no index): where the store's time goes besides the segment I/O."""
    tier = NvmeTier(path, nvme)
    try:
        t0 = time.perf_counter()
        placements = [p for batch in writes for p in tier.put(batch)]
        put_s = time.perf_counter() - t0
        tier.drop_page_cache()
        pairs = list(zip(w.keys, placements))
        t0 = time.perf_counter()
        for k, p in pairs:
            if tier.get_into(k, p, out) != w.size:
                raise RuntimeError(f"benchmark block {k.hex()} unreadable from the NVMe tier")
        get_s = time.perf_counter() - t0
    finally:
        tier.close()
        shutil.rmtree(path, ignore_errors=True)
    return put_s, get_s


def bench_nvme(w: Workload, out: memoryview, root: str, repeats: int, bar, segment_bytes: int | None) -> dict:
    nvme = NvmeConfig(fsync="always", **({"segment_bytes": segment_bytes} if segment_bytes else {}))
    items, writes, last = w.items(), w.writes(), {}

    def runner(kind: str, fn, path: str):
        def op() -> float:   # _rounds times puts; the get of the same round is kept aside
            put_s, get_s = fn(path)
            last.setdefault(kind, []).append(get_s)
            return put_s
        return op

    times = _rounds({
        "raw": runner("raw", lambda p: _raw_round(w, out, p), os.path.join(root, "raw.bin")),
        "tier": runner("tier", lambda p: _tier_round(w, writes, out, p, nvme), os.path.join(root, "tier")),
        "store": runner("store", lambda p: _store_round(w, items, out, p, nvme), os.path.join(root, "store")),
    }, repeats, bar)
    res = {f"{k}_{'write' if k == 'raw' else 'put'}": _gbps(w.nbytes, _median(t)) for k, t in times.items()}
    for kind, gets in last.items():  # drop the warm-up round's get
        res[f"{kind}_{'read' if kind == 'raw' else 'get'}"] = _gbps(w.nbytes, _median(gets[1:] or gets))
    return res


# ---------------------------------------------------------------- hashing and lookup
def bench_hash(runs: int) -> dict[str, float]:
    tokens = np.random.default_rng(0).integers(0, 129_280, _PROMPT_TOKENS, dtype=np.int32)
    out = {}
    for algo in (HashAlgo.XXH3_128, HashAlgo.SHA256):
        ns = Namespace(_NS.model_fingerprint, _NS.kv_layout, 256, algo=algo)
        hash_blocks(ns, tokens)  # warm-up
        times = []
        for _ in range(runs):
            t0 = time.perf_counter()
            hash_blocks(ns, tokens)
            times.append(time.perf_counter() - t0)
        out[algo.value] = _median(times) * 1e3
    return out


def build_index(path: str, n_blocks: int, chain: list[bytes], progress: bool, batch: int = 20_000) -> float:
    """An index of `n_blocks` entries: the chained keys plus random 16-byte keys. Seconds taken."""
    index = Index(path, sync=False)
    t0, now, rec = time.perf_counter(), time.time(), (1 << 20) + 4096
    rand = os.urandom(16 * max(0, n_blocks - len(chain)))
    keys = chain + [rand[i: i + 16] for i in range(0, len(rand), 16)]
    try:
        index.add_namespace(_NS)
        with tqdm(total=n_blocks, desc="building index", unit="blk", leave=False, disable=not progress) as bar:
            for a in range(0, n_blocks, batch):
                index.commit({k: BlockMeta(_NS.id, 1 << 20, Tier.NVME, now, now, segment_id=1,
                                           offset=4096 + i * rec, record_len=rec)
                              for i, k in enumerate(keys[a: a + batch], a)}, new_segments=[1])
                bar.update(min(batch, n_blocks - a))
    finally:
        index.close()
    return time.perf_counter() - t0


def bench_lookup(root: str, n_blocks: int, runs: int, progress: bool) -> dict:
    m = min(_LOOKUP_BLOCKS, n_blocks)
    chain = hash_blocks(_NS, np.arange(m * _NS.block_size, dtype=np.int32) % 100_000)
    data_dir = os.path.join(root, "lookup")
    build_s = build_index(os.path.join(data_dir, "index"), n_blocks, chain, progress)
    store = BlockStore(StoreConfig(data_dir, dram=None, nvme=NvmeConfig(fsync="always")))
    env, db = store.index.env, store.index._blocks

    def raw() -> None:
        with env.begin(db=db, buffers=True) as txn:
            for k in chain:
                if txn.get(k) is None:
                    raise RuntimeError("lookup benchmark key missing from the index")

    try:
        if store.lookup(chain).num_hits != m:
            raise RuntimeError(f"lookup found {store.lookup(chain).num_hits} of {m} present blocks")
        t_store = _best_of(lambda: store.lookup(chain), runs)
        t_raw = _best_of(raw, runs)
    finally:
        store.close()
        shutil.rmtree(data_dir, ignore_errors=True)
    return {"index_blocks": n_blocks, "lookup_blocks": m, "build_s": build_s, "store_ms": t_store * 1e3,
            "raw_lmdb_ms": t_raw * 1e3, "store_vs_raw_lmdb": t_raw / t_store}


def _best_of(fn, runs: int) -> float:
    """Median seconds of `runs` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return _median(times)


# ---------------------------------------------------------------- machine and report
def _meminfo_total() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _filesystem(path: str) -> dict:
    st = os.statvfs(path)
    out = {"path": os.path.abspath(path), "size_bytes": st.f_blocks * st.f_frsize,
           "free_bytes": st.f_bavail * st.f_frsize}
    try:
        lines = subprocess.run(["df", "-PT", path], capture_output=True, text=True, timeout=10).stdout.splitlines()
        dev, fstype, *_rest, mount = lines[1].split()
        out.update(device=dev, type=fstype, mount=mount)
    except (OSError, IndexError, ValueError, subprocess.SubprocessError):
        pass
    return out


def machine_info(data_dir: str) -> dict:
    return {"uname": platform.uname()._asdict(), "cpu_count": os.cpu_count(), "mem_total_bytes": _meminfo_total(),
            "filesystem": _filesystem(data_dir), "python": sys.version.split()[0],
            "python_impl": platform.python_implementation(), "kvcache": __version__,
            "numpy": np.__version__}


def _ratios(r: dict) -> dict[str, float]:
    d, n = r["dram"], r["nvme"]
    return {"dram_get_vs_memcpy": d["store_get"] / d["memcpy_get"],
            "dram_put_vs_memcpy": d["store_put"] / d["memcpy_put"],
            "dram_tier_get_vs_memcpy": d["tier_get"] / d["memcpy_get"],
            "dram_tier_put_vs_memcpy": d["tier_put"] / d["memcpy_put"],
            "nvme_put_vs_raw_write": n["store_put"] / n["raw_write"],
            "nvme_get_vs_raw_read": n["store_get"] / n["raw_read"],
            "nvme_tier_put_vs_raw_write": n["tier_put"] / n["raw_write"],
            "nvme_tier_get_vs_raw_read": n["tier_get"] / n["raw_read"]}


def summarize(per_size: dict[str, dict]) -> dict:
    """Per-size ratio dicts, the worst case of each at top level, and target flags."""
    by_ratio: dict[str, dict[str, float]] = {}
    for label, r in per_size.items():
        for name, v in r["ratios"].items():
            by_ratio.setdefault(name, {})[label] = v
    out = {name: min(vals.values()) for name, vals in by_ratio.items()}
    out["ratios_per_size"] = by_ratio
    out["targets"] = {name: {"target": t, "worst": out[name], "pass": out[name] >= t,
                             "per_size_pass": {s: v >= t for s, v in by_ratio[name].items()}}
                      for name, t in TARGETS.items()}
    return out


def format_table(doc: dict) -> str:
    rows = [("size", "operation", "kvcache GB/s", "baseline", "GB/s", "ratio", "target")]
    spec = [("dram get (store)", "dram", "store_get", "memcpy", "memcpy_get", "dram_get_vs_memcpy"),
            ("dram get (tier)", "dram", "tier_get", "memcpy", "memcpy_get", None),
            ("dram put (store)", "dram", "store_put", "memcpy", "memcpy_put", None),
            ("dram put (tier)", "dram", "tier_put", "memcpy", "memcpy_put", None),
            ("nvme put (store)", "nvme", "store_put", "write+fsync", "raw_write", "nvme_put_vs_raw_write"),
            ("nvme put (tier)", "nvme", "tier_put", "write+fsync", "raw_write", None),
            ("nvme cold get (store)", "nvme", "store_get", "cold pread", "raw_read", "nvme_get_vs_raw_read"),
            ("nvme cold get (tier)", "nvme", "tier_get", "cold pread", "raw_read", None)]
    for label, r in doc["sizes"].items():
        for name, tier, op, base, bop, target in spec:
            ours, ref = r[tier][op], r[tier][bop]
            mark = "" if target is None else f">={TARGETS[target]} {'ok' if ours / ref >= TARGETS[target] else 'MISS'}"
            rows.append((label, name, f"{ours:.2f}", base, f"{ref:.2f}", f"{ours / ref:.2f}", mark))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    lk = doc["lookup"]
    lines += ["", f"hash 128k tokens / 256-token blocks: xxh3-128 {doc['hash_128k_ms']:.2f} ms, "
                  f"sha256 {doc['hash_128k_sha256_ms']:.2f} ms",
              f"lookup {lk['lookup_blocks']} blocks in a {lk['index_blocks']:,}-block index: "
              f"store {lk['store_ms']:.3f} ms, raw LMDB {lk['raw_lmdb_ms']:.3f} ms "
              f"(ratio {lk['store_vs_raw_lmdb']:.2f}; index built in {lk['build_s']:.1f} s)"]
    lines += [f"target {name} >= {t['target']}: worst {t['worst']:.2f} -> {'PASS' if t['pass'] else 'MISS'}"
              for name, t in doc["targets"].items()]
    return "\n".join(lines)


def write_results(doc: dict, out_dir: str) -> tuple[str, str]:
    os.makedirs(out_dir, exist_ok=True)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    path, latest = (os.path.join(out_dir, f"tier_throughput-{s}.json") for s in (stamp, "latest"))
    doc["files"] = {"json": os.path.abspath(path), "latest": os.path.abspath(latest)}
    text = json.dumps(doc, indent=2, sort_keys=False) + "\n"
    for p in (path, latest):
        with open(p + ".tmp", "w") as f:
            f.write(text)
        os.replace(p + ".tmp", p)
    return path, latest


# ---------------------------------------------------------------- entry points
def _scratch_dir(data_dir: str | None) -> str:
    """A fresh directory for the run's files, inside `data_dir` (default: the current directory)."""
    parent = data_dir or os.getcwd()
    os.makedirs(parent, exist_ok=True)
    if not os.access(parent, os.W_OK):
        parent = tempfile.gettempdir()
    return tempfile.mkdtemp(prefix=".kvcache-bench-", dir=parent)


def run(sizes, total_bytes: int, out_dir: str, repeats: int = 3, *, batch_bytes: int = 16 << 20,
        data_dir: str | None = None, index_blocks: int = 1_000_000, segment_bytes: int | None = None,
        hash_runs: int = 7, lookup_runs: int = 11, progress: bool = True, echo: bool = True) -> dict:
    """Run the whole benchmark; write the JSON report into `out_dir` and return it."""
    sizes = parse_sizes(sizes) if isinstance(sizes, str) else [int(s) for s in sizes]
    if not sizes or repeats < 1 or total_bytes <= 0 or index_blocks < 1:
        raise ValueError("need at least one size, repeats >= 1, total bytes > 0 and index blocks >= 1")
    root = _scratch_dir(data_dir)
    source = memoryview(os.urandom(max(total_bytes, max(sizes))))
    out = memoryview(bytearray(max(sizes)))
    region = memoryview(bytearray(max(total_bytes, max(sizes))))
    per_size: dict[str, dict] = {}
    started = time.perf_counter()
    try:
        with tqdm(total=2 * len(sizes) * (repeats + 1) + 2, desc="tier benchmark", unit="step",
                  disable=not progress) as bar:
            for size in sizes:
                w = make_workload(source, size, total_bytes, batch_bytes)
                bar.set_postfix_str(f"{size_label(size)} dram")
                r = {"block_bytes": size, "blocks": len(w.blocks), "bytes": w.nbytes,
                     "dram": bench_dram(w, out, region, root, repeats, bar)}
                bar.set_postfix_str(f"{size_label(size)} nvme")
                r["nvme"] = bench_nvme(w, out, root, repeats, bar, segment_bytes)
                r["ratios"] = _ratios(r)
                per_size[size_label(size)] = r
            bar.set_postfix_str("hashing")
            hashes = bench_hash(hash_runs)
            bar.update(1)
            bar.set_postfix_str("lookup")
            lookup = bench_lookup(root, index_blocks, lookup_runs, progress)
            bar.update(1)
        machine = machine_info(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    doc = {"benchmark": "tier_throughput", "time_utc": dt.datetime.now(dt.timezone.utc).isoformat(),
           "elapsed_s": time.perf_counter() - started, "machine": machine,
           "config": {"sizes": [size_label(s) for s in sizes], "total_bytes_per_size": total_bytes,
                      "repeats": repeats, "batch_bytes": batch_bytes, "index_blocks": index_blocks,
                      "segment_bytes": segment_bytes or NvmeConfig().segment_bytes, "hash_runs": hash_runs,
                      "lookup_runs": lookup_runs, "data_dir": os.path.abspath(os.path.dirname(root)),
                      "units": "GB/s = 1e9 bytes/s; ratios = kvcache throughput / baseline throughput",
                      "top_level_ratios": "BlockStore path, worst case over sizes"},
           "sizes": per_size}
    doc.update(summarize(per_size))
    doc.update(hash_128k_ms=hashes["xxh3-128"], hash_128k_sha256_ms=hashes["sha256"], hash_128k_ms_by_algo=hashes,
               lookup_1000_in_1M_ms=lookup["store_ms"], lookup=lookup)
    write_results(doc, out_dir)
    if echo:
        print(format_table(doc))
        print(f"\nwrote {doc['files']['json']}\n  and {doc['files']['latest']}")
    return doc


def add_arguments(p: argparse.ArgumentParser, default_out_dir: str = "benchmarks/results") -> None:
    p.add_argument("--sizes", default=DEFAULT_SIZES, type=parse_sizes, metavar="LIST",
                   help=f"comma-separated block sizes, K/M/G suffixes (default: {DEFAULT_SIZES})")
    p.add_argument("--total-mib", type=float, default=256, metavar="MIB",
                   help="bytes moved per block size and operation, in MiB (default: 256)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per measurement; the median "
                   "is reported, after one warm-up run (default: 3)")
    p.add_argument("--batch-mib", type=float, default=16, metavar="MIB",
                   help="blocks per put_many / per fdatasync of the baseline, in MiB (default: 16)")
    p.add_argument("--index-blocks", type=int, default=1_000_000, metavar="N",
                   help="entries in the index for the 1,000-block lookup (default: 1000000)")
    p.add_argument("--segment-mib", type=float, default=None, metavar="MIB",
                   help="NVMe segment size (default: the NvmeConfig default)")
    p.add_argument("--data-dir", default=None, metavar="DIR",
                   help="where the NVMe and index files go: a scratch directory is made inside it and "
                        "removed afterwards (default: the current directory; use the disk you care about)")
    p.add_argument("--out-dir", default=default_out_dir, metavar="DIR",
                   help=f"where the JSON reports go (default: {default_out_dir})")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run_from_args(args: argparse.Namespace) -> dict:
    mib = 1 << 20
    return run(args.sizes, int(args.total_mib * mib), args.out_dir, args.repeats,
               batch_bytes=int(args.batch_mib * mib), data_dir=args.data_dir, index_blocks=args.index_blocks,
               segment_bytes=int(args.segment_mib * mib) if args.segment_mib else None,
               progress=not args.no_progress)
