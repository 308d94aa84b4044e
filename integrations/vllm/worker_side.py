"""The connector in each vLLM worker: blocks copied between vLLM's KV tensors and the store.

    start_load_kv      each load, in the loader thread: on the CPU, get_many_into straight into
                       the claimed blocks of every layer (a Scatter per block); on an accelerator,
                       into a host staging buffer, then the rows that loaded are copied over
    wait_for_save      each save: the blocks are copied out (a copy thread) and handed to the
                       seam's saver thread; once copied out, vLLM may reuse them
    get_finished       loads done (finished_recving) and finished requests whose copies are done
                       (finished_sending: vLLM held their blocks for us)
    handle_preemptions blocks go back to the pool this step: wait until pending copies are out

A load that fails, misses a block, or is not done within `load_timeout_s` reports its blocks in
get_block_ids_with_load_errors, with the request finished receiving: vLLM recomputes them. An
abandoned load never writes into vLLM's blocks afterwards (its job's lock and flag); a load that
is writing straight into them is abandoned only once that read returns.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from kvcache.integrations.vllm.kv_blocks import KVBlocks
from kvcache.integrations.vllm.metadata import KVCacheMetadata, Transfer

log = logging.getLogger(__name__)
MAX_BLOCKS_PER_CALL = 64        # one get_many_into / one gather at most (and the staging buffers)
STAGING_BYTES = 32 << 20        # ... and so does this: a load's chunk holds at most this many bytes
RECENT_LOADS = 64               # loads whose (bytes, seconds) the counters keep
KEEP_STAGING = 4                # staging buffers kept for the next copies (fresh ones page-fault in)


@dataclass
class LoadJob:
    req_id: str
    block_ids: list[int]
    started: float
    pending: int = 0                    # fetches not finished yet
    failed: set[int] = field(default_factory=set)
    abandoned: bool = False
    writing: bool = False               # a chunk is being read straight into the blocks
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class WorkerCounters:
    loaded_blocks: int = 0
    failed_blocks: int = 0
    abandoned_loads: int = 0
    saved_blocks: int = 0
    load_bytes: int = 0
    load_seconds: float = 0.0           # in the store (get_many_into)
    scatter_seconds: float = 0.0        # copying loaded rows into vLLM's KV
    load_wall_s: float = 0.0            # loads from start to the last block copied into vLLM's KV
    loads: list = field(default_factory=list)   # (bytes, seconds) of recent loads, from start to last copy


class WorkerSide:
    def __init__(self, seam, blocks: KVBlocks, rank: int, *, load_timeout_s: float, clock=time.monotonic):
        self.seam, self.blocks, self.rank = seam, blocks, rank
        self.load_timeout_s, self._clock = load_timeout_s, clock
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvcache-vllm-load")
        self._copier = ThreadPoolExecutor(1, thread_name_prefix="kvcache-vllm-copy")
        self._lock = threading.Lock()
        self._loads: dict[str, LoadJob] = {}
        self._copies: dict[str, list[Future]] = {}     # req_id -> its pending copy-outs
        self._held: set[str] = set()                   # finished requests vLLM holds blocks of for us
        self._finished: set[str] = set()               # ... of those, the ones vLLM said finished
        self._ingested: KVCacheMetadata | None = None  # the step whose saves and holds were taken
        self._errors: set[int] = set()
        self._free_staging: list[torch.Tensor] = []
        self._load_done = threading.Event()
        self.chunk_blocks = max(1, min(MAX_BLOCKS_PER_CALL, STAGING_BYTES // max(1, blocks.payload_bytes)))
        self.direct = blocks.direct and getattr(getattr(seam, "store", None), "reads_scatter", False)
        # a direct load needs no staging, so one read takes as many blocks as a call may
        self.load_blocks = MAX_BLOCKS_PER_CALL if self.direct else self.chunk_blocks
        self.counters = WorkerCounters()

    # ------------------------------------------------------------ loads
    def start_loads(self, meta: KVCacheMetadata) -> None:
        """Queue each load's chunks for the loader thread: one chunk in flight at a time, so the
        loads hold one staging buffer however much KV they claim."""
        for t in meta.loads:
            job = LoadJob(t.req_id, t.block_ids, self._clock())
            keys = t.keys[self.rank]
            step = self.load_blocks
            chunks = [(i, min(i + step, len(keys))) for i in range(0, len(keys), step)]
            job.pending = len(chunks)
            with self._lock:
                self._loads[t.req_id] = job
            for a, b in chunks:
                self._loader.submit(self._load_chunk, job, keys[a:b], a)

    def _load_chunk(self, job: LoadJob, keys: list[bytes], a: int) -> None:
        if job.abandoned:                   # timed out: its blocks are recomputed, nothing to fetch
            return self._chunk_done(job)
        if self.direct:
            return self._load_direct(job, keys, a)
        staging = self._take_staging()[: len(keys)]
        try:
            t0 = time.perf_counter()
            lengths = self.seam.get_now(keys, [memoryview(row.numpy()) for row in staging])
            self._scatter(job, a, staging, lengths, time.perf_counter() - t0)
        except Exception as e:              # the seam turns store errors into misses; this is ours
            log.warning("cache load of %d blocks failed (%s): they are recomputed", len(keys), e)
            with job.lock:
                job.failed.update(job.block_ids[a:a + len(keys)])
        finally:
            self._give_staging(staging)
            self._chunk_done(job)

    def _load_direct(self, job: LoadJob, keys: list[bytes], a: int) -> None:
        """The chunk read straight into vLLM's blocks (one copy). While it writes, the job is not
        abandoned (`writing`): its blocks stay the request's until the read returns. A daemon
        that stops answering fails the read after the client's timeout_s; one that keeps
        sending, however slowly, holds the load until its bytes are in."""
        ids = job.block_ids[a:a + len(keys)]
        with job.lock:
            if job.abandoned:
                return self._chunk_done(job, locked=True)
            job.writing = True
        lengths: list = [None] * len(keys)
        t0 = time.perf_counter()
        try:
            lengths = self.seam.get_now(keys, self.blocks.destinations(ids))
        except Exception as e:              # the seam turns store errors into misses; this is ours
            log.warning("cache load of %d blocks failed (%s): they are recomputed", len(keys), e)
        finally:
            with job.lock:                  # one hold: a finished read is never taken for a timeout
                job.writing = False
                self._count_load(job, ids, lengths, time.perf_counter() - t0)
                self._chunk_done(job, locked=True)

    def _count_load(self, job: LoadJob, ids: list[int], lengths: list, seconds: float) -> None:
        want = self.blocks.payload_bytes
        ok = sum(n == want for n in lengths)
        job.failed.update(b for b, n in zip(ids, lengths) if n != want)
        c = self.counters
        c.loaded_blocks, c.failed_blocks = c.loaded_blocks + ok, c.failed_blocks + len(ids) - ok
        c.load_bytes += ok * want
        c.load_seconds += seconds

    def _scatter(self, job: LoadJob, a: int, staging: torch.Tensor, lengths: list, seconds: float) -> None:
        want = self.blocks.payload_bytes
        ok = [i for i, n in enumerate(lengths) if n == want]
        ids = job.block_ids[a:a + len(lengths)]
        with job.lock:                      # an abandoned job's blocks are vLLM's again: never written
            if job.abandoned:
                return
            t0 = time.perf_counter()
            try:
                self.blocks.scatter(staging, ok, [ids[i] for i in ok])
                if self.blocks.device.type != "cpu":       # copied before the buffer is reused
                    torch.accelerator.synchronize()
            except Exception as e:
                log.warning("copying %d loaded blocks into vLLM's KV failed (%s): they are recomputed", len(ok), e)
                lengths = [None] * len(lengths)
            self._count_load(job, ids, lengths, seconds)
            self.counters.scatter_seconds += time.perf_counter() - t0

    def _chunk_done(self, job: LoadJob, locked: bool = False) -> None:
        if not locked:
            with job.lock:
                return self._chunk_done(job, locked=True)
        job.pending -= 1
        if job.pending:
            return
        self._load_done.set()
        if not job.abandoned:
            wall = self._clock() - job.started
            self.counters.load_wall_s += wall
            done = (len(job.block_ids) * self.blocks.payload_bytes, wall)
            self.counters.loads = self.counters.loads[-(RECENT_LOADS - 1):] + [done]

    def _take_staging(self) -> torch.Tensor:
        with self._lock:
            if self._free_staging:
                return self._free_staging.pop()
        return self.blocks.staging(self.chunk_blocks)

    def _give_staging(self, staging: torch.Tensor) -> None:
        base = staging._base if staging._base is not None else staging
        with self._lock:
            if len(self._free_staging) < KEEP_STAGING:
                self._free_staging.append(base)

    def wait_loads(self, timeout_s: float) -> None:
        """Block up to `timeout_s` for a pending load to finish. vLLM steps in a loop while its
        requests wait for loads, and that loop holds the GIL our copying threads need: each block
        of a load then waits out the interpreter's switch interval (measured: a 128 MiB load took
        ~80 ms in vLLM against ~8 ms alone). Called only on steps that compute nothing."""
        with self._lock:
            pending = bool(self._loads)
        if pending:
            self._load_done.wait(timeout_s)
            self._load_done.clear()

    def _loads_done(self) -> set[str]:
        done, now = set(), self._clock()
        with self._lock:
            jobs = list(self._loads.values())
        for job in jobs:
            with job.lock:
                if job.pending and not job.writing and now - job.started > self.load_timeout_s:
                    job.abandoned = True
                    self.counters.abandoned_loads += 1
                    log.warning("cache load of %d blocks took over %g s: abandoned, they are recomputed",
                                len(job.block_ids), self.load_timeout_s)
                    job.failed.update(job.block_ids)
                if job.pending and not job.abandoned:
                    continue
                self._errors.update(job.failed)
            done.add(job.req_id)
            with self._lock:
                self._loads.pop(job.req_id, None)
        return done

    # ------------------------------------------------------------ saves
    def start_saves(self, meta: KVCacheMetadata) -> None:
        """This step's copy-outs, and the requests whose blocks vLLM now holds until they are
        done. Once per step: vLLM calls wait_for_save, and with speculative decoding it asks
        get_finished first (after the target's forward, before the drafter's); whichever comes
        first takes them, so a finished request is never reported before its last copy-out."""
        if meta is self._ingested:
            return
        self._ingested = meta
        with self._lock:
            self._held.update(meta.holds)
        if not meta.saves:
            return
        ready = None
        if self.blocks.device.type == "cuda":          # the copy thread waits for this step's kernels
            ready = torch.cuda.Event()
            ready.record()
        elif self.blocks.device.type != "cpu":
            torch.accelerator.synchronize()
        for t in meta.saves:
            for a in range(0, len(t.block_ids), self.chunk_blocks):
                b = min(a + self.chunk_blocks, len(t.block_ids))
                fut = self._copier.submit(self._copy_out, t, a, b, ready)
                with self._lock:
                    self._copies.setdefault(t.req_id, []).append(fut)

    def _copy_out(self, t: Transfer, a: int, b: int, ready) -> None:
        if ready is not None:
            ready.synchronize()
        buf = self._take_staging()
        try:
            staging = self.blocks.gather(t.block_ids[a:b], buf)
        except Exception as e:
            self._give_staging(buf)
            log.warning("copying %d blocks out of vLLM's KV failed (%s): they stay uncached", b - a, e)
            return
        rows = staging.numpy()
        self.seam.save([(k, memoryview(rows[i])) for i, k in enumerate(t.keys[self.rank][a:b])],
                       on_done=lambda: self._give_staging(buf))
        self.counters.saved_blocks += b - a

    def wait_copies(self) -> None:
        """Until every copy-out submitted so far is done (before vLLM reuses blocks)."""
        with self._lock:
            futs = [f for fs in self._copies.values() for f in fs]
        for f in futs:
            f.result()

    def flush(self) -> None:
        """Until everything copied out so far has landed in the store (or failed)."""
        self.wait_copies()
        self.seam.flush()

    def _copies_done(self, finished_req_ids: set[str]) -> set[str]:
        """Held requests (the scheduler said so: exactly those it returned True for) that vLLM
        has said finished and whose copy-outs are all done."""
        done = set()
        with self._lock:
            self._finished.update(finished_req_ids & self._held)
            for rid in list(self._copies):
                self._copies[rid] = [f for f in self._copies[rid] if not f.done()]
                if not self._copies[rid] and rid not in self._held:
                    del self._copies[rid]               # a running request's copies, all done
            for rid in list(self._finished):
                if not self._copies.get(rid):
                    self._finished.discard(rid)
                    self._held.discard(rid)
                    self._copies.pop(rid, None)
                    done.add(rid)
        return done

    # ------------------------------------------------------------ reports
    def finished(self, finished_req_ids: set[str], meta: KVCacheMetadata | None = None):
        """(finished sending, finished receiving), None for an empty set, as vLLM asks."""
        if meta is not None:
            self.start_saves(meta)
        sending, recving = self._copies_done(set(finished_req_ids or ())), self._loads_done()
        return sending or None, recving or None

    def take_errors(self) -> set[int]:
        with self._lock:
            errors, self._errors = self._errors, set()
        return errors

    def close(self) -> None:
        self._loader.shutdown(wait=True)
        self._copier.shutdown(wait=True)
        self.seam.close()
        self.seam.store.close()
