"""AccessLog: one JSON object per line with fixed keys, UTC time, bounded strings, flushed per
line, and write errors counted and logged once, never raised."""

import io
import json
import logging

from kvcache.server.model_api.access_log import FIELDS, MAX_FIELD_CHARS, AccessLog

NOON = 1767268800.25          # 2026-01-01T12:00:00.250Z


class Flushes(io.StringIO):
    def __init__(self):
        super().__init__()
        self.flushed: list[str] = []

    def flush(self):
        self.flushed.append(self.getvalue())


class Broken(io.StringIO):
    def write(self, s):
        raise OSError(28, "No space left on device")


def record(**fields) -> dict:
    base = dict(method="POST", path="/v1/chat/completions", status=200, tenant="alice", api="chat",
                request_id="req-1", prompt_tokens=600, cached_tokens=512, generated_tokens=12, ttft_s=0.0421234567,
                duration_s=0.5, finish_reason="stop", error=None)
    return {**base, **fields}


def test_one_json_object_per_line_with_every_field_in_order():
    out = io.StringIO()
    log = AccessLog(out, clock=lambda: NOON)
    log.write(record())
    log.write(record(status=429, error="busy", finish_reason=None))
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and out.getvalue().endswith("\n")
    first, second = (json.loads(line) for line in lines)
    assert tuple(first) == FIELDS
    assert first["time"] == "2026-01-01T12:00:00.250Z"
    assert first["prompt_tokens"] == 600 and first["cached_tokens"] == 512 and first["ttft_s"] == 0.042123
    assert (second["status"], second["error"], second["finish_reason"]) == (429, "busy", None)


def test_missing_fields_are_null_and_unknown_keys_dropped():
    out = io.StringIO()
    AccessLog(out, clock=lambda: NOON).write({"method": "GET", "path": "/v1/models", "status": 200,
                                              "authorization": "Bearer secret"})
    line = json.loads(out.getvalue())
    assert tuple(line) == FIELDS and line["tenant"] is None and line["ttft_s"] is None
    assert "secret" not in out.getvalue()


def test_each_line_is_flushed_as_it_is_written():
    out = Flushes()
    log = AccessLog(out)
    log.write(record(request_id="a"))
    log.write(record(request_id="b"))
    assert [text.count("\n") for text in out.flushed] == [1, 2]


def test_long_strings_are_cut_and_control_characters_stay_on_the_line():
    out = io.StringIO()
    AccessLog(out).write(record(path="/v1/" + "p" * 5000, error="x" * 5000, request_id="evil\n{\"status\":200}"))
    assert out.getvalue().count("\n") == 1
    line = json.loads(out.getvalue())
    assert len(line["path"]) == MAX_FIELD_CHARS and len(line["error"]) == MAX_FIELD_CHARS
    assert line["request_id"] == "evil\n{\"status\":200}"


def test_odd_values_become_valid_json():
    out = io.StringIO()
    AccessLog(out).write(record(ttft_s=float("nan"), duration_s=float("inf"), error=ValueError("bad"),
                                time="2026-01-01T00:00:00Z"))
    line = json.loads(out.getvalue())
    assert line["ttft_s"] is None and line["duration_s"] is None and line["error"] == "bad"
    assert line["time"] == "2026-01-01T00:00:00Z"


def test_write_errors_are_counted_and_logged_once(caplog):
    log = AccessLog(Broken())
    with caplog.at_level(logging.WARNING, logger="kvcache.server.model_api.access_log"):
        for _ in range(3):
            log.write(record())
    assert log.errors == 3
    assert len([r for r in caplog.records if "access log" in r.getMessage()]) == 1


def test_a_closed_stream_does_not_raise():
    out = io.StringIO()
    out.close()
    log = AccessLog(out)
    log.write(record())
    assert log.errors == 1
