"""ParquetEventLog: the store's events, kept in rotated Parquet files for `kvcache report`.

    store thread:  record(event) ──> in-memory buffer (bounded; full -> dropped and counted)
    log thread:    buffer >= buffer_events, or publish_s since the last batch ──> one row group
                   appended to events-<UTC>-<seq>.parquet.<pid>.tmp, and the same rows as a
                   small closed file events-<UTC>-<seq>.live-<n>.parquet (readable at once)
                   file older than rotate_s or larger than rotate_bytes ──> close, fsync, rename
                   to events-<UTC>-<seq>.parquet, then remove its .live-<n> files
    reader:        read_events(dir, since) ──> one pyarrow Table of every closed file, and of the
                   live files of each file not closed yet (a reader never sees a half-written file)

Why this shape: the store calls `record` on its hot path and under its own locks, so
`record` only appends to a list; all encoding and I/O happen on the log's thread. A Parquet
file is readable only once its footer is written, so the open file carries a `.tmp` suffix
until it is closed; the live files make a running daemon's events readable within
`publish_s` (`kvcache report` on a live daemon) without closing a file every few seconds.
A reader ignores the live files of a file that is closed (a crash between the rename and their
removal leaves both). A crash loses the open file, but its live files stay readable: at most
`publish_s` of events are lost, and hit-rate reports are statistics, cheaper than fsyncing per event.

pyarrow is imported lazily, inside the functions that need it, so that importing the store
(or this module) never pays for it.
"""

from __future__ import annotations

import dataclasses
import glob
import logging
import os
import re
import threading
import time
from typing import Callable

from kvcache.kvstore.durable import fsync_dir, replace_synced
from kvcache.kvstore.events import Event

__all__ = ["ParquetEventLog", "read_events", "event_files", "live_files", "event_schema", "FIELDS"]
log = logging.getLogger(__name__)

FIELDS = tuple(f.name for f in dataclasses.fields(Event))
_TYPES = {f.name: f.type if isinstance(f.type, str) else f.type.__name__ for f in dataclasses.fields(Event)}
_ZERO = {"float": 0.0, "int": 0, "str": ""}
_DEFAULTS = {f.name: _ZERO[_TYPES[f.name]] if f.default is dataclasses.MISSING else f.default
             for f in dataclasses.fields(Event)}
_PREFIX, _SUFFIX = "events-", ".parquet"
_LIVE = re.compile(r"(events-.+)\.live-\d{6}\.parquet")   # group 1 + _SUFFIX: the file it belongs to


def event_schema():
    """The Parquet schema: one column per `Event` field, derived so the two never drift apart."""
    import pyarrow as pa
    kinds = {"float": pa.float64(), "int": pa.int64(), "str": pa.string()}
    return pa.schema([pa.field(name, kinds[_TYPES[name]]) for name in FIELDS],
                     metadata={"kvcache.event_log": "1"})


class ParquetEventLog:
    """An `EventSink` that writes events to rotated Parquet files in `directory`.

    `record` never blocks on I/O and never raises: when the writer falls behind and the
    buffer holds `max_buffer_events` (default 10 x buffer_events), new events are dropped and
    counted in `dropped`. Call `close()` to write the last file; `flush()` writes what is
    buffered now, readable at once (and rotates if due), which tests use with a fake clock.
    """

    def __init__(self, directory: str, *, rotate_bytes: int = 64 << 20, rotate_s: float = 3600.0,
                 buffer_events: int = 10_000, max_buffer_events: int | None = None,
                 clock: Callable[[], float] = time.time, tick_s: float = 1.0, compression: str = "zstd",
                 publish_s: float = 10.0):
        if buffer_events < 1 or rotate_s <= 0 or rotate_bytes < 1 or publish_s <= 0:
            raise ValueError("buffer_events, rotate_s, rotate_bytes and publish_s must be positive")
        import pyarrow.parquet  # noqa: F401  fail here, at start-up, not on the first write
        self.directory = directory
        self.rotate_bytes, self.rotate_s, self.publish_s = rotate_bytes, rotate_s, publish_s
        self._published = clock()              # when the last batch was taken
        self._live_seq = 0                     # live files of the open file so far
        self.buffer_events = buffer_events
        self.max_buffer_events = max_buffer_events or 10 * buffer_events
        self.clock, self.compression = clock, compression
        self.recorded = self.written = self.dropped = self.files = 0
        self._buf: list[Event] = []
        self._lock = threading.Lock()          # guards the buffer and counters; held for microseconds
        self._io_lock = threading.Lock()       # one writer of the open file at a time
        self._writer = self._tmp_path = self._final_path = None
        self._schema = event_schema()
        self._period_start: float | None = None   # when the first event of the open file was recorded
        self._closed = False
        os.makedirs(directory, exist_ok=True)
        _remove_stale_tmp(directory)
        self._wake, self._stop = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, args=(tick_s,), name="kvcache-events", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- the store's side
    def record(self, event: Event) -> None:
        with self._lock:
            self.recorded += 1
            if self._closed or len(self._buf) >= self.max_buffer_events:
                self.dropped += 1
                return
            self._buf.append(event)
            if self._period_start is None:
                self._period_start = self.clock()
            full = len(self._buf) >= self.buffer_events
        if full:
            self._wake.set()

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"recorded": self.recorded, "written": self.written, "dropped": self.dropped,
                    "buffered": len(self._buf), "files": self.files}

    # ---------------------------------------------------------------- lifecycle
    def flush(self) -> None:
        """Write everything buffered into the open file; close the file if rotation is due."""
        self._service(force=True)

    def close(self) -> None:
        """Stop the thread, write the buffer and close the open file. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=60)
        if self._thread.is_alive():
            log.error("event log writer is stuck; %d buffered events are lost", len(self._buf))
            return
        self._service(force=True, final=True)

    def __enter__(self) -> "ParquetEventLog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---------------------------------------------------------------- the log thread's side
    def _run(self, tick_s: float) -> None:
        while not self._stop.is_set():
            self._wake.wait(tick_s)
            self._wake.clear()
            if self._stop.is_set():
                break
            try:
                self._service(force=False)
            except Exception:  # the log thread must outlive any one bad batch
                log.exception("event log: writing events failed")

    def _service(self, force: bool, final: bool = False) -> None:
        """One round of the writer: take a batch if one is due, append it, rotate if due.
        Events buffered when the file's time is up still go into that file: they were
        recorded before the rotation was noticed (at most one tick late)."""
        with self._io_lock:
            with self._lock:
                now = self.clock()
                due = final or (self._period_start is not None and now - self._period_start >= self.rotate_s)
                publish = bool(self._buf) and now - self._published >= self.publish_s
                batch = []
                if force or due or publish or len(self._buf) >= self.buffer_events:
                    batch, self._buf = self._buf, []
                    self._published = now
            table = self._write(batch) if batch else None
            if self._writer is not None and (due or _size(self._tmp_path) >= self.rotate_bytes):
                self._finish_file()
                due = True
            elif table is not None:
                self._publish(table)
            if due:  # the next file's age counts from its first event
                with self._lock:
                    self._period_start = self.clock() if self._buf else None

    def _write(self, batch: list[Event]):
        """Append the batch to the open file; its table, or None when it could not be written."""
        try:
            table = self._to_table(batch)
            if self._writer is None:
                self._open_file()
            self._write_rows(table)
        except Exception:
            log.exception("event log: %d events could not be written to %s; dropped", len(batch), self.directory)
            with self._lock:
                self.dropped += len(batch)
            self._abandon_file()
            return None
        with self._lock:
            self.written += len(batch)
        return table

    def _to_table(self, batch: list[Event]):
        import pyarrow as pa
        return pa.table({f: [getattr(e, f) for e in batch] for f in FIELDS}, schema=self._schema)

    def _write_rows(self, table) -> None:
        """One row group. Separate so that tests can stand in a slow or failing disk."""
        self._writer.write_table(table)

    def _publish(self, table) -> None:
        """The rows just appended to the open file, also as a closed file of their own, so that
        readers see them now rather than at rotation. Best effort: a failure only delays them."""
        import pyarrow.parquet as pq
        self._live_seq += 1
        path = f"{self._final_path[: -len(_SUFFIX)]}.live-{self._live_seq:06d}{_SUFFIX}"
        tmp = f"{path}.{os.getpid()}.tmp"
        try:
            pq.write_table(table, tmp, compression=self.compression)
            replace_synced(tmp, path)
        except Exception:
            log.exception("event log: could not write %s; its events become readable at rotation", path)
            _unlink(tmp)

    def _open_file(self) -> None:
        import pyarrow.parquet as pq
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(self._period_start or self.clock()))
        self._final_path = _free_name(self.directory, stamp)
        self._tmp_path = f"{self._final_path}.{os.getpid()}.tmp"
        self._writer = pq.ParquetWriter(self._tmp_path, self._schema, compression=self.compression)

    def _finish_file(self) -> None:
        """Footer, fsync, rename: from here on readers see the whole file or none of it.
        A file that cannot be finished is removed (its footer is missing: nobody could read it)."""
        writer, tmp, final = self._writer, self._tmp_path, self._final_path
        self._writer = self._tmp_path = None
        live, self._live_seq = self._live_seq, 0
        try:
            writer.close()
            replace_synced(tmp, final)
        except Exception:   # its live files stay: what they hold is still readable
            log.exception("event log: could not close %s; removing it", tmp)
            _unlink(tmp)
            return
        _fsync_dir(self.directory)
        for n in range(1, live + 1):   # the closed file holds their rows now
            _unlink(f"{final[: -len(_SUFFIX)]}.live-{n:06d}{_SUFFIX}")
        with self._lock:
            self.files += 1

    def _abandon_file(self) -> None:
        """After a failed write: keep the row groups already written if the file still closes."""
        if self._writer is not None:
            self._finish_file()


# -------------------------------------------------------------------- reading
def event_files(directory: str) -> list[str]:
    """Closed event files, oldest first (names sort by UTC time, then sequence number)."""
    return [p for p in _parquet_files(directory) if not _LIVE.fullmatch(os.path.basename(p))]


def live_files(directory: str) -> list[str]:
    """The live files of event files not closed yet (a running log's recent events), oldest first."""
    out = []
    for p in _parquet_files(directory):
        m = _LIVE.fullmatch(os.path.basename(p))
        if m and not os.path.exists(os.path.join(directory, m[1] + _SUFFIX)):
            out.append(p)
    return out


def _parquet_files(directory: str) -> list[str]:
    return sorted(glob.glob(os.path.join(glob.escape(directory), f"{_PREFIX}*{_SUFFIX}")))


def read_events(directory: str, since: float | None = None, *, progress: bool = False):
    """Every event in the closed files of `directory` and in the live files of those not closed
    yet (with time >= since), as a pyarrow Table with `event_schema()`. Open `.tmp` files are
    never read. A file that cannot be read is skipped with a warning: a report over most of the
    data beats no report. A live file removed while reading (its file closed meanwhile) starts
    the reading over, so that no event is counted twice or missed."""
    import pyarrow as pa
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"event log directory {directory} does not exist")
    for _ in range(5):
        tables = _read_all(event_files(directory) + live_files(directory), since, progress)
        if tables is not None:
            break
    else:
        tables = _read_all(event_files(directory), since, progress) or []
    if not tables:
        return event_schema().empty_table()
    return pa.concat_tables(tables)


def _read_all(files: list[str], since: float | None, progress: bool) -> list | None:
    """One table per readable file; None when a file vanished since it was listed."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    schema, tables = event_schema(), []
    if progress and len(files) > 50:
        from tqdm import tqdm
        files = tqdm(files, desc="reading event files", unit="file", leave=False)
    filters = [("time", ">=", float(since))] if since is not None else None
    for path in files:
        try:
            tables.append(_conform(pq.read_table(path, filters=filters), schema))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, pa.ArrowException) as e:
            log.warning("skipping unreadable event file %s: %s", path, e)
    return tables


def _conform(table, schema):
    """Cast a file's table to the current schema: columns added to `Event` since the file was
    written get their defaults, columns since removed are dropped."""
    import pyarrow as pa
    cols = []
    for field in schema:
        if field.name in table.column_names:
            col = table.column(field.name).cast(field.type)
            cols.append(col.fill_null(_DEFAULTS[field.name]))
        else:
            cols.append(pa.array([_DEFAULTS[field.name]] * table.num_rows, field.type))
    return pa.Table.from_arrays(cols, schema=schema)


# -------------------------------------------------------------------- files
def _free_name(directory: str, stamp: str) -> str:
    """events-<stamp>-<seq>.parquet that no closed, open or live file uses yet."""
    taken = os.listdir(directory)
    for seq in range(1_000_000):
        base = f"{_PREFIX}{stamp}-{seq:06d}"
        if not any(t.startswith(base + ".") for t in taken):
            return os.path.join(directory, base + _SUFFIX)
    raise RuntimeError(f"no free event file name for {stamp} in {directory}")


def _remove_stale_tmp(directory: str) -> None:
    """An open file left by a process that died has no footer and can never be read: remove it.
    Files of a live process (another log on the same directory) are left alone. Live files of a
    closed file (a crash right after closing it) are removed too: the closed file holds their rows."""
    for path in _parquet_files(directory):
        m = _LIVE.fullmatch(os.path.basename(path))
        if m and os.path.exists(os.path.join(directory, m[1] + _SUFFIX)):
            _unlink(path)
    for path in glob.glob(os.path.join(glob.escape(directory), f"{_PREFIX}*{_SUFFIX}.*.tmp")):
        try:
            pid = int(path.rsplit(".", 2)[-2])
        except ValueError:
            continue
        if pid != os.getpid() and not _alive(pid):
            log.warning("removing %s: its writer (pid %d) died before closing it", path, pid)
            try:
                os.unlink(path)
            except OSError:
                pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _size(path: str | None) -> int:
    try:
        return os.path.getsize(path) if path else 0
    except OSError:
        return 0


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _fsync_dir(directory: str) -> None:
    try:
        fsync_dir(directory)
    except OSError:  # best effort, like the rest of the log: its events are statistics
        pass
