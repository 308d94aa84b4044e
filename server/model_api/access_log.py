"""The model server's access log: one JSON object per request, one per line, flushed at once.

Every line has the same keys in the same order (FIELDS; null where the request has no value), so
a log shipper needs no schema per route. A line is bounded: strings are cut at MAX_FIELD_CHARS
(a path, an error message or a client's request id can be arbitrarily long) and keys outside
FIELDS are dropped. JSON escapes control characters, so no value can start a line of its own.

Logging must never fail a request: an error while writing (a full disk, a closed pipe) is counted
in `errors` and logged once; the lines it hits are lost. Writes are synchronous on the caller's
thread: give it a file, or a pipe that is read promptly.
"""

from __future__ import annotations

import json
import logging
import math
import time
from datetime import datetime, timezone
from typing import Callable, TextIO

log = logging.getLogger(__name__)

MAX_FIELD_CHARS = 512
FIELDS = ("time", "method", "path", "status", "tenant", "api", "request_id", "prompt_tokens", "cached_tokens",
          "generated_tokens", "ttft_s", "duration_s", "finish_reason", "error")


class AccessLog:
    def __init__(self, stream: TextIO, clock: Callable[[], float] = time.time):
        self.stream, self._clock = stream, clock
        self.errors = 0            # lines lost to write errors

    def write(self, record: dict) -> None:
        """Log one request. `time` (ISO-8601 UTC) is now unless the record gives one."""
        try:
            line = self.format(record)
            self.stream.write(line)
            self.stream.flush()
        except Exception as e:     # whatever the stream does, the request that logs goes on
            self.errors += 1
            if self.errors == 1:
                log.warning("access log: a line could not be written (%s); further failures are only "
                            "counted", e)

    def format(self, record: dict) -> str:
        fields = {name: _bounded(record.get(name)) for name in FIELDS}
        if fields["time"] is None:
            fields["time"] = _iso_utc(self._clock())
        return json.dumps(fields, separators=(",", ":"), allow_nan=False) + "\n"


def _iso_utc(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _bounded(value: object) -> object:
    """A JSON scalar of bounded size: numbers as they are (non-finite ones as null), the rest as
    strings cut at MAX_FIELD_CHARS."""
    if value is None or isinstance(value, (bool, int)):
        return value
    if isinstance(value, float):
        return round(value, 6) if math.isfinite(value) else None
    text = value if isinstance(value, str) else str(value)
    return text[:MAX_FIELD_CHARS]
