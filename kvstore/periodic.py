"""A daemon thread that calls one function at a fixed interval until stopped."""

from __future__ import annotations

import logging
import threading
from typing import Callable

log = logging.getLogger(__name__)


class Periodic(threading.Thread):
    def __init__(self, name: str, interval_s: float, fn: Callable[[], object]):
        super().__init__(name=name, daemon=True)
        self.interval_s, self.fn = interval_s, fn
        self._stop_event = threading.Event()
        self.start()

    def run(self) -> None:
        while not self._stop_event.wait(self.interval_s):
            try:
                self.fn()
            except Exception:  # background work must never take the store down; retry next tick
                log.exception("%s failed; retrying in %.1f s", self.name, self.interval_s)

    def stop(self) -> None:
        self._stop_event.set()
        if self is not threading.current_thread():
            self.join()
