"""Object-store calls with a deadline each, behind a circuit breaker.

    closed ──(breaker_failures consecutive failures)──> open
    open ──(breaker_cooldown_s passed; the next call is the probe)──> half-open
    half-open ──probe succeeds──> closed        half-open ──probe fails──> open (new cool-down)

While open (and while a half-open probe is in flight) every call fails at once with
`ObjectStoreUnavailable` without touching the network. "Not found" is an answer, not a
failure: it counts as a success for the breaker and is raised as FileNotFoundError.

Deadlines: calls on an async filesystem (s3fs) run on its event loop under
`asyncio.wait_for`, which cancels the request at the deadline; calls on a synchronous one
(local files) run in a small thread pool and the caller stops waiting at the deadline.

`make_fs` builds the tier's filesystem with those deadlines and no retries of its own; fsspec
(and s3fs for s3://) are imported only then.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from typing import Any, Callable

from kvcache.kvstore.errors import StoreError
from kvcache.tiering.config import ObjectConfig

log = logging.getLogger(__name__)

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half-open"


class ObjectStoreUnavailable(StoreError):
    """The object store failed, timed out, or the breaker is open: treat as a miss / retry later."""


class CircuitBreaker:
    def __init__(self, failures: int, cooldown_s: float, clock: Callable[[], float] = time.monotonic,
                 on_change: Callable[[str, str], None] | None = None):
        self.threshold, self.cooldown_s, self._clock = failures, cooldown_s, clock
        self._on_change = on_change
        self._lock = threading.Lock()
        self.state = CLOSED
        self.consecutive = 0
        self.opened_at = 0.0
        self._probing = False
        self.counters = {"failures": 0, "rejected": 0, "opened": 0, "half_opened": 0, "closed": 0}
        self.last_error = ""

    def _set(self, state: str) -> None:
        old, self.state = self.state, state
        self.counters[{"open": "opened", "half-open": "half_opened", "closed": "closed"}[state]] += 1
        log.log(logging.WARNING if state == OPEN else logging.INFO,
                "object store circuit breaker %s -> %s (%s)", old, state, self.last_error or "ok")
        if self._on_change is not None:
            self._on_change(old, state)

    def allow(self) -> bool:
        with self._lock:
            if self.state == CLOSED:
                return True
            if self.state == OPEN and self._clock() - self.opened_at >= self.cooldown_s:
                self._set(HALF_OPEN)
                self._probing = True
                return True
            if self.state == HALF_OPEN and not self._probing:
                self._probing = True
                return True
            self.counters["rejected"] += 1
            return False

    def retry_in(self) -> float:
        """Seconds until a call may be tried again (0 when it may now)."""
        with self._lock:
            if self.state == OPEN:
                return max(0.0, self.opened_at + self.cooldown_s - self._clock())
            return 0.0

    def success(self) -> None:
        with self._lock:
            self.consecutive = 0
            self._probing = False
            if self.state != CLOSED:
                self.last_error = ""
                self._set(CLOSED)

    def failure(self, err: BaseException | str) -> None:
        with self._lock:
            self.counters["failures"] += 1
            self.consecutive += 1
            self.last_error = err if isinstance(err, str) else f"{type(err).__name__}: {err}"
            if self.state == HALF_OPEN or (self.state == CLOSED and self.consecutive >= self.threshold):
                self._probing = False
                self.opened_at = self._clock()
                self._set(OPEN)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"state": self.state, "consecutive_failures": self.consecutive,
                    "last_error": self.last_error, **self.counters}


class FsIO:
    """fsspec calls through the breaker, each with a deadline."""

    def __init__(self, fs, breaker: CircuitBreaker, timeout_s: float, workers: int = 8):
        self.fs, self.breaker, self.timeout_s = fs, breaker, timeout_s
        self._async = bool(getattr(fs, "async_impl", False))
        self._pool = None if self._async else concurrent.futures.ThreadPoolExecutor(
            workers, thread_name_prefix="kvcache-objio")

    def call(self, name: str, *args, timeout: float | None = None, **kwargs):
        if not self.breaker.allow():
            raise ObjectStoreUnavailable(f"object store unavailable (circuit {self.breaker.state}): "
                                         f"{self.breaker.last_error}")
        deadline = self.timeout_s if timeout is None else timeout
        try:
            result = self._run(name, args, kwargs, deadline)
        except FileNotFoundError:
            self.breaker.success()  # the store answered
            raise
        except Exception as e:
            if isinstance(e, (concurrent.futures.TimeoutError, TimeoutError)) or type(e).__name__ == "FSTimeoutError":
                e = TimeoutError(f"{name} took longer than {deadline:.1f}s")
            self.breaker.failure(e)
            raise ObjectStoreUnavailable(f"object store {name} failed: {type(e).__name__}: {e}") from e
        except BaseException as e:   # KeyboardInterrupt, cancellation: resolve a probe, re-raise as is
            self.breaker.failure(e)
            raise
        self.breaker.success()
        return result

    def _run(self, name: str, args, kwargs, deadline: float):
        if self._async:
            from fsspec.asyn import sync
            return sync(self.fs.loop, getattr(self.fs, "_" + name), *args, timeout=deadline, **kwargs)
        fut = self._pool.submit(getattr(self.fs, name), *args, **kwargs)
        try:
            return fut.result(deadline)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def make_fs(cfg: ObjectConfig):
    try:
        import fsspec
    except ImportError as e:
        raise StoreError("the object tier needs fsspec (and s3fs for s3://): pip install 'kvcache[object]'") from e
    proto, _ = cfg.split_url()
    opts = dict(cfg.storage_options)
    opts.setdefault("skip_instance_cache", True)   # we tune retries/timeouts on our own instance
    if proto in ("s3", "s3a"):
        ck = dict(opts.get("config_kwargs") or {})
        ck.setdefault("connect_timeout", cfg.timeout_s)
        ck.setdefault("read_timeout", cfg.timeout_s)
        # no hidden botocore retries (a refused connection would sleep up to 1 s): the breaker decides
        ck.setdefault("retries", {"total_max_attempts": 1, "mode": "standard"})
        opts["config_kwargs"] = ck
    try:
        return fsspec.filesystem(proto, **opts)
    except ImportError as e:
        raise StoreError(f"object tier url {cfg.url!r} needs a driver: {e} (for s3://: pip install s3fs)") from e
    except (ValueError, TypeError) as e:
        raise StoreError(f"object tier url {cfg.url!r}: bad storage_options: {e}") from e
