"""`kvcache bench lmcache`: the daemon side by side with LMCache's multiprocess server on the
same requests: store, warm retrieve (DRAM), and retrieve after a restart of each server (its
disk tier only), for an MLA-like request (15 chunks of 17.2 MiB) and an MHA-like one (8 of
32 MiB), as LMCache's own `lmcache bench server` sends them.

    LMCache                                         kvcache (the same bytes, the same blocks)
    lmcache server --shm-name (L1 DRAM, fs L2)      kvcache serve (DRAM, NVMe fsync "always")
    lmcache bench server: per request               KVClient over the unix socket, shared memory:
      LOOKUP, STORE (cold) / LOOKUP, RETRIEVE         lookup, put_many / lookup, get_many_into
    stop, start on the same L2 directory            stop, start on the same data directory
    lmcache bench server again: LOOKUP (prefetch    lookup, get_many_into (NVMe: segment files)
      L2 -> L1), RETRIEVE

Each side's numbers are its own client's clock around each call (LMCache's: the `[seq N/...]`
lines its bench prints). LMCache's lookup polls for the prefetch's end every 50 ms, so its
lookups cost at least that: retrieves are compared alone and with their lookup. LMCache acks a
store before its copy reaches disk, without fsync; the daemon's puts are durable. LMCache is not
a dependency: it is found on PATH (or --lmcache), else the benchmark says how to install it and
exits 2 (a CPU-only install needs --no-deps; benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass

from kvcache.benchmarks.baselines import dest_buffer, scratch_dir
from kvcache.benchmarks.daemon_servers import (MissingDependency, daemon_config, print_report, start_daemon,
                                               stop_daemon)
from kvcache.benchmarks.record import load_now, machine_info, write_results
from kvcache.tiering.slab import SlabAllocator


@dataclass(frozen=True)
class Shape:
    name: str
    spec: str                # lmcache's --kvcache-shape-spec: (kv, tokens/chunk, ?, heads, dim):dtype:layers
    tokens: int              # --num-tokens (its bench stores whole 256-token chunks of tokens + 1)
    chunks: int
    chunk_bytes: int         # 256 tokens x layers x kv x heads x dim x dtype bytes

    @property
    def nbytes(self) -> int:
        return self.chunks * self.chunk_bytes


SHAPES = {"mla": Shape("mla", "(1,256,16,1,576):bfloat16:61", 3840, 15, 256 * 61 * 576 * 2),
          "mha": Shape("mha", "(2,256,16,8,128):float16:32", 2048, 8, 256 * 32 * 2 * 8 * 128 * 2)}
WARMUP = 1                   # first requests per shape and side, not counted (first touches, connections)
INTERVAL_S = 0.5             # between requests, both sides (lmcache bench server --interval)
# like for like only: LMCache reads its disk tier during the lookup after a restart (its retrieve
# is then a DRAM copy), so a restart read is lookup + retrieve; its store does not fsync, the
# daemon's does, which the name says
SPEEDUPS = {"store_fsync_vs_no_fsync": "store", "warm_retrieve": "warm_retrieve",
            "warm_lookup_plus_retrieve": "warm_lookup_plus_retrieve",
            "restart_lookup_plus_retrieve": "restart_lookup_plus_retrieve"}      # name -> phase
PHASES = ("store", "warm_lookup", "warm_retrieve", "restart_lookup", "restart_retrieve")
INSTALL_HINT = ("LMCache is not installed (no `lmcache` on PATH; or pass --lmcache PATH). Its CPU-only install "
                "needs its own virtual environment and --no-deps: see benchmarks/README.md, `kvcache bench lmcache`")
_ENV = {"LMCACHE_DISABLE_BANNER": "1", "PYTHONHASHSEED": "0", "LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1"}
_LINE = re.compile(r"\[seq (\d+)/(cold|warm)\] (LOOKUP|STORE|RETRIEVE): (.*?)\(([^)]*?)([\d.]+) ms")


def find_lmcache(path: str | None) -> str:
    exe = path or os.environ.get("KVCACHE_LMCACHE") or shutil.which("lmcache")
    if not exe or not os.access(exe, os.X_OK):
        raise MissingDependency(INSTALL_HINT)
    return exe


def parse_bench_log(text: str) -> dict[int, dict]:
    """{sequence: {phase: ms, ...}} from `lmcache bench server`'s lines; lookups also give the
    chunks hit (`*_hits`). cold STORE -> store; after a restart, cold RETRIEVE is the L2 read."""
    out: dict[int, dict] = {}
    for seq, kind, op, status, detail, ms in _LINE.findall(re.sub(r"\x1b\[[0-9;]*m", "", text)):
        r = out.setdefault(int(seq), {})
        r[f"{kind}_{op.lower()}"] = float(ms)
        if op == "LOOKUP":
            r[f"{kind}_lookup_hits"] = int(status.split("/")[0])
        elif not status.strip().startswith(("stored", "retrieved")):
            r[f"{kind}_{op.lower()}_failed"] = status.strip()
    return out


# ---------------------------------------------------------------- LMCache
def _free_ports(n: int) -> list[int]:
    """`n` distinct free loopback ports (all bound at once, so none is handed out twice)."""
    import socket
    with contextlib.ExitStack() as held:
        socks = [held.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def _start_lmcache(cleanup, exe: str, root: str, l2: str, l1_gb: float) -> dict:
    """`lmcache server` in a session of its own (its listener is a child process: the whole
    group is stopped), shared-memory transfers on, an fs L2 in `l2`."""
    rpc, http, prom = _free_ports(3)
    shm = f"kvcache_bench_{os.getpid()}_{rpc}"          # a name per start: never a stale segment
    argv = [exe, "server", "--host", "127.0.0.1", "--port", str(rpc), "--http-port", str(http),
            "--prometheus-port", str(prom), "--chunk-size", "256", "--l1-size-gb", str(l1_gb), "--no-l1-use-lazy",
            "--eviction-policy", "LRU", "--supported-transfer-mode", "auto",
            "--shm-name", shm,
            "--l2-adapter", json.dumps({"type": "fs", "base_path": l2})]
    log = os.path.join(root, "lmcache-server.log")
    with open(log, "ab") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env={**os.environ, **_ENV})
    server = {"argv": argv[1:], "proc": proc, "rpc": f"tcp://127.0.0.1:{rpc}", "url": f"http://127.0.0.1:{http}"}
    cleanup.callback(_stop_group, proc, shm)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        with contextlib.suppress(OSError):
            if urllib.request.urlopen(server["url"] + "/healthcheck", timeout=1).status == 200:
                return server
        time.sleep(0.5)
    with open(log, errors="replace") as f:
        raise RuntimeError(f"lmcache server did not start; its output:\n{f.read()[-2000:]}")


def _stop_group(proc: subprocess.Popen, shm: str) -> None:
    """Stop the server's process group, and remove its shared-memory L1 (gigabytes of tmpfs)
    should it have left it behind."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    with contextlib.suppress(ProcessLookupError):      # its children, had the leader gone first
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join("/dev/shm", shm))


def _lmcache_bench(exe: str, server: dict, shape: Shape, first: int, n: int, root: str, tag: str) -> dict[int, dict]:
    argv = [exe, "bench", "server", "--rpc-url", server["rpc"], "--url", server["url"], "--mode", "cpu",
            "--num-tokens", str(shape.tokens), "--start", str(first), "--end", str(first + n),
            "--interval", str(INTERVAL_S), "--kvcache-shape-spec", shape.spec]
    r = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, **_ENV}, timeout=900)
    with open(os.path.join(root, f"lmcache-bench-{tag}.log"), "w") as f:
        f.write(r.stdout + r.stderr)
    got = parse_bench_log(r.stdout + r.stderr)
    if r.returncode != 0 or len(got) != n:
        raise RuntimeError(f"lmcache bench server ({tag}) exited {r.returncode} with {len(got)} of {n} requests; "
                           f"its output ends:\n{(r.stdout + r.stderr)[-2000:]}")
    return got


def _wait_files(path: str, n: int, timeout_s: float = 300) -> None:
    """LMCache writes L2 after acknowledging: wait for its `n` chunk files before the restart."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if len([f for f in os.listdir(path) if f.endswith(".data")]) >= n:
            return
        time.sleep(0.5)
    raise RuntimeError(f"LMCache's L2 holds fewer than the {n} chunks stored after {timeout_s:g} s")


def lmcache_side(exe: str, shapes: list[Shape], requests: int, root: str) -> dict:
    """Each shape's requests through a fresh LMCache server, then again after restarting it."""
    l2 = os.path.join(root, "lmcache-l2")
    os.makedirs(l2)
    l1_gb = round(2.5 * requests * sum(s.nbytes for s in shapes) / 2 ** 30 + 0.5, 1)
    first = {s.name: 1000 * i for i, s in enumerate(shapes)}      # keys omit the shape: no overlap
    with contextlib.ExitStack() as cleanup:
        server = _start_lmcache(cleanup, exe, root, l2, l1_gb)
        before = {s.name: _lmcache_bench(exe, server, s, first[s.name], requests, root, f"{s.name}-1") for s in shapes}
        _wait_files(l2, requests * sum(s.chunks for s in shapes))
    with contextlib.ExitStack() as cleanup:
        server = _start_lmcache(cleanup, exe, root, l2, l1_gb)
        after = {s.name: _lmcache_bench(exe, server, s, first[s.name], requests, root, f"{s.name}-2") for s in shapes}
    out = {}
    for s in shapes:
        rows = [(before[s.name][q], after[s.name][q]) for q in sorted(before[s.name])]
        for b, a in rows:
            if b.get("warm_lookup_hits") != s.chunks or a.get("cold_lookup_hits") != s.chunks:
                raise RuntimeError(f"LMCache did not find every chunk of a {s.name} request (L1 full? before "
                                   f"{b.get('warm_lookup_hits')}, after the restart {a.get('cold_lookup_hits')})")
        out[s.name] = {"store": [b["cold_store"] for b, _ in rows], "warm_lookup": [b["warm_lookup"] for b, _ in rows],
                       "warm_retrieve": [b["warm_retrieve"] for b, _ in rows],
                       "restart_lookup": [a["cold_lookup"] for _, a in rows],
                       "restart_retrieve": [a["cold_retrieve"] for _, a in rows]}
    return {"ms": out, "server_argv": server["argv"], "l1_size_gb": l1_gb}


# ---------------------------------------------------------------- kvcache
def kvcache_side(shapes: list[Shape], requests: int, root: str, sock_dir: str) -> dict:
    """The same requests (one block per chunk) through the daemon: durable puts, shared-memory gets."""
    from kvcache.benchmarks.daemon import _NS
    from kvcache.client.sync_client import KVClient
    from kvcache.kvstore.types import PutItem
    sizes = [s.chunk_bytes for s in shapes]
    cfg = daemon_config(sizes, requests * max(s.nbytes for s in shapes), 1)
    page = cfg["dram"]["page_bytes"]            # DRAM for every request of every shape, no more
    need = sum(requests * s.chunks * SlabAllocator(page, page).chunk_size(s.chunk_bytes) for s in shapes)
    cfg["dram"]["capacity_bytes"] = int(need / 0.85) + 4 * page
    blocks = {s.name: [[os.urandom(16) for _ in range(s.chunks)] for _ in range(requests)] for s in shapes}
    dst = {s.name: dest_buffer(s.nbytes) for s in shapes}       # one request's KV
    source = os.urandom(max(s.chunk_bytes for s in shapes))
    ms: dict = {s.name: {p: [] for p in PHASES} for s in shapes}

    def timed(f) -> tuple[object, float]:
        t0 = time.perf_counter()
        v = f()
        return v, (time.perf_counter() - t0) * 1e3

    def read(c, s: Shape, keys, phase: str) -> None:
        hits, t = timed(lambda: c.lookup(keys).num_hits)
        views = [dst[s.name][i * s.chunk_bytes: (i + 1) * s.chunk_bytes] for i in range(s.chunks)]
        got, t2 = timed(lambda: c.get_many_into(keys, views))
        if hits != s.chunks or got != [s.chunk_bytes] * s.chunks:
            raise RuntimeError(f"the daemon did not return every block of a {s.name} request ({phase})")
        ms[s.name][f"{phase}_lookup"].append(t)
        ms[s.name][f"{phase}_retrieve"].append(t2)

    with contextlib.ExitStack() as cleanup:
        d = start_daemon(cleanup, root, sock_dir, cfg, "daemon-vs-lmcache")
        with KVClient("http://localhost", unix_socket=d["unix_socket"], retries=0, timeout_s=300,
                      shared_memory="on") as c:
            c._shared()                   # maps the arena (once per client) before any clock starts
            c.register_namespace(_NS)
            for s in shapes:
                for keys in blocks[s.name]:
                    r, t = timed(lambda: c.put_many([PutItem(k, memoryview(source)[: s.chunk_bytes], _NS.id)
                                                     for k in keys]))
                    if r.stored != s.chunks or r.durable is not True:
                        raise RuntimeError("the daemon's puts were not all durable")
                    ms[s.name]["store"].append(t)
                    read(c, s, keys, "warm")
                    time.sleep(INTERVAL_S)
        stop_daemon(d)
        d = start_daemon(cleanup, root, sock_dir, cfg, "daemon-vs-lmcache")
        with KVClient("http://localhost", unix_socket=d["unix_socket"], retries=0, timeout_s=300,
                      shared_memory="on") as c:
            c._shared()
            for s in shapes:
                for keys in blocks[s.name]:
                    read(c, s, keys, "restart")
                    time.sleep(INTERVAL_S)
        stop_daemon(d)
    return {"ms": ms, "daemon_argv": d["argv"], "daemon_config": cfg}


# ---------------------------------------------------------------- the report
def summarize(shapes: list[Shape], ours: dict, theirs: dict) -> dict:
    """Per shape: medians (ms), GB/s, and each phase's speedup (LMCache ms / kvcache ms, >1: we are faster)."""
    out: dict = {}
    for s in shapes:
        a, b = ours["ms"][s.name], theirs["ms"][s.name]
        med = {side: {p: statistics.median(v[p][WARMUP:]) for p in PHASES}
               for side, v in (("kvcache", a), ("lmcache", b))}
        for m in med.values():
            m["restart_lookup_plus_retrieve"] = m["restart_lookup"] + m["restart_retrieve"]
            m["warm_lookup_plus_retrieve"] = m["warm_lookup"] + m["warm_retrieve"]
        out[s.name] = {"request_bytes": s.nbytes, "chunks": s.chunks, "chunk_bytes": s.chunk_bytes,
                       "lmcache_shape_spec": s.spec, "median_ms": med,
                       "gb_s": {side: {p: s.nbytes / m[p] / 1e6 for p in m if "lookup" not in p or "plus" in p}
                                for side, m in med.items()},
                       "speedup_vs_lmcache": {name: med["lmcache"][p] / med["kvcache"][p]
                                              for name, p in SPEEDUPS.items()}}
    return out


def format_table(doc: dict) -> str:
    lines = ["median ms per request (GB/s); speedup = LMCache ms / kvcache ms; after a restart LMCache reads its "
             "disk during the lookup; its stores do not fsync, the daemon's do:"]
    for shape, r in doc["shapes"].items():
        lines.append(f"  {shape}: {r['chunks']} chunks of {r['chunk_bytes'] / 2 ** 20:.1f} MiB")
        for name, p in SPEEDUPS.items():
            k, m = r["median_ms"]["kvcache"][p], r["median_ms"]["lmcache"][p]
            lines.append(f"    {name:<30} kvcache {k:8.1f} ({r['request_bytes'] / k / 1e6:5.2f})   lmcache {m:8.1f} "
                         f"({r['request_bytes'] / m / 1e6:5.2f})   speedup {r['speedup_vs_lmcache'][name]:5.2f}")
    return "\n".join(lines)


def run(shape_names: list[str], requests: int, out_dir: str, *, lmcache: str | None = None,
        data_dir: str | None = None) -> dict:
    """Both sides, the JSON report in `out_dir`; MissingDependency without LMCache."""
    exe = find_lmcache(lmcache)
    shapes = [SHAPES[n] for n in shape_names]
    started, load = time.perf_counter(), load_now()
    root, sock_dir = scratch_dir(data_dir), tempfile.mkdtemp(prefix="kvl-")
    try:
        ours = kvcache_side(shapes, requests + WARMUP, root, sock_dir)
        theirs = lmcache_side(exe, shapes, requests + WARMUP, root)
        machine = {**machine_info(root), "load_at_start": load}
    finally:
        shutil.rmtree(root, True)
        shutil.rmtree(sock_dir, True)
    python = os.path.join(os.path.dirname(exe), "python")        # the environment LMCache is installed in
    version = subprocess.run([python, "-c", "import importlib.metadata as m; print(m.version('lmcache'))"],
                             capture_output=True, text=True).stdout.strip() if os.access(python, os.X_OK) else ""
    doc = {"benchmark": "lmcache_side", "time_utc": dt.datetime.now(dt.timezone.utc).isoformat(),
           "elapsed_s": time.perf_counter() - started, "machine": machine,
           "config": {"shapes": shape_names, "requests_per_shape": requests, "lmcache": exe,
                      "lmcache_version": version or None, "lmcache_server_argv": theirs["server_argv"],
                      "daemon_argv": ours["daemon_argv"], "daemon_config": ours["daemon_config"],
                      "warmup_requests": WARMUP,
                      "units": "ms per request (each side's own client clock); GB/s = request bytes / ms / 1e6"},
           "notes": [__doc__.split("\n\n", 2)[2].replace("\n", " ").strip()],
           "raw_ms": {"kvcache": ours["ms"], "lmcache": theirs["ms"]}, "shapes": summarize(shapes, ours, theirs)}
    write_results(doc, out_dir, "lmcache_side")
    return doc


def run_args(args: argparse.Namespace) -> int:
    return print_report("lmcache", lambda: run(args.shapes, args.requests, args.out_dir, lmcache=args.lmcache,
                                               data_dir=args.data_dir), format_table)


def main(argv: list[str] | None = None) -> int:
    from kvcache.benchmarks import verbs
    try:
        return verbs.main("lmcache_side", argv)
    except KeyboardInterrupt:   # servers and scratch directories are already cleaned up
        return 130


if __name__ == "__main__":
    sys.exit(main())
