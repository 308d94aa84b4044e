"""What the daemon answers when a request fails, and what it logs about it.

    handler raises ─┬─ the client hung up (client_gone): logged at DEBUG, nothing to answer
                    └─ error_for(exc) ─┬─ a client's mistake (bad input, a limit, an unknown
                                       │  namespace, a full tier): 4xx/5xx JSON {"error","message"},
                                       │  nothing logged
                                       └─ anything else (a bug): 500, logged with its traceback

A client's bytes are parsed where they enter (parse_json, server/request_body.py's layout_header,
kvstore/wire.py's frames) so that each mistake gets a message that says what to send instead;
the table below is the net under those parsers. QuietBadRequests does the same for the
requests aiohttp itself cannot parse.
"""

from __future__ import annotations

import asyncio
import json
import logging

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from kvcache.server.quota import QuotaExceeded
from kvcache.kvstore import wire
from kvcache.kvstore.errors import (BlockFormatError, NamespaceLimitError, StoreError, TierFullError,
                                    UnknownNamespaceError)

log = logging.getLogger("kvcache.server")

# The parsers turn what a request's own bytes can raise (a TypeError from a field of the wrong
# type, an OverflowError from a number no float holds, a RecursionError from JSON nested too
# deeply) into BlockFormatError or ValueError where they parse, so the net stops there: a
# struct.error, KeyError or TypeError from deeper down is damage or a bug, a logged 500.
_ERRORS = ((UnknownNamespaceError, 422, "unknown_namespace"), (wire.FrameLimitError, 413, "request_entity_too_large"),
           (BlockFormatError, 400, "bad_request"), (ValueError, 400, "bad_request"),
           (web.RequestPayloadError, 400, "bad_request"), (asyncio.IncompleteReadError, 400, "truncated_body"),
           (TierFullError, 507, "insufficient_storage"), (QuotaExceeded, 507, "quota_exceeded"),
           (NamespaceLimitError, 429, "too_many_namespaces"),
           (StoreError, 503, "store_unavailable"))


def error_response(status: int, code: str, message: str) -> web.Response:
    """The JSON error body; a 503 (a limit that passes: pending uploads, a busy daemon) says
    when to try again."""
    headers = {"Retry-After": "1"} if status == 503 else None
    return web.json_response({"error": code, "message": message}, status=status, headers=headers)


def error_for(exc: BaseException) -> tuple[int, str, str] | None:
    """(status, code, message) for the errors a request can cause; None for a bug (500)."""
    if isinstance(exc, web.HTTPException):
        return exc.status, exc.reason.lower().replace(" ", "_"), exc.text or exc.reason
    for kind, status, code in _ERRORS:
        if isinstance(exc, kind):
            return status, code, str(exc)[:1000] if code != "truncated_body" else \
                "the request body ended in the middle of a frame"
    return None


@web.middleware
async def error_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return error_response(*error_for(e))
    except Exception as e:
        if client_gone(request, e):     # nobody left to answer: the reply only ends the request
            log.debug("client closed the connection during %s %s: %r", request.method, request.path, e)
            return error_response(400, "client_closed_request", "the connection closed before the answer")
        known = error_for(e)
        if known is not None:
            return error_response(*known)
        log.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(500, "internal", "internal error; see the daemon log")


def client_gone(request: web.Request, exc: BaseException) -> bool:
    """True when `exc` comes from the client hanging up (a reset, a body cut short by the close,
    a write to its closed socket), not from the daemon: its connection is closed or closing."""
    transport = request.transport
    closed = transport is None or transport.is_closing()
    return closed and isinstance(exc, (ConnectionError, web.RequestPayloadError, asyncio.IncompleteReadError))


def parse_json(raw: bytes | str, what: str):
    """JSON from a client; anything that is no JSON, or is nested past what the parser can
    follow (no body of the API nests more than a few levels), is a BlockFormatError (400)."""
    try:
        return json.loads(raw)
    except ValueError as e:      # JSONDecodeError, bytes that are no Unicode text, a 5,000-digit integer
        raise BlockFormatError(f"{what} is not JSON: {e}") from None
    except RecursionError:
        raise BlockFormatError(f"{what} is JSON nested too deeply; the API's bodies nest a few levels") from None


class QuietBadRequests(logging.Filter):
    """aiohttp logs every request it cannot parse (a bad request line, a header past 8 KiB, a
    malformed Content-Length) at ERROR with a traceback, before any token is checked: anyone who
    reaches the port could fill the log. Those are the client's mistakes (aiohttp answers them
    400/413/431), so they go to DEBUG without the traceback; a 5xx keeps its ERROR."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError) and 400 <= (exc.code or 500) < 500:
            record.msg, record.args = f"{record.getMessage()}: {exc.code} {exc.message}"[:300], ()
            record.levelno, record.levelname, record.exc_info, record.exc_text = logging.DEBUG, "DEBUG", None, None
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True


def quiet_bad_requests() -> None:
    """Install QuietBadRequests on aiohttp's protocol logger once (the app may be built often)."""
    logger = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, QuietBadRequests) for f in logger.filters):
        logger.addFilter(QuietBadRequests())
