"""What a handler reads from a request: hex block keys mapped into the tenant's key space, JSON
bodies and plain bodies within their limits and the request's deadline, and the layout header.

Malformed input is a BlockFormatError (400) with a message that says what to send instead;
a body past its limit is a 413, one that arrives too slowly a 408.
"""

from __future__ import annotations

import asyncio
import re

from aiohttp import web

from kvcache.kvstore import wire
from kvcache.kvstore.errors import BlockFormatError
from kvcache.kvstore.hashing import tenant_key
from kvcache.kvstore.types import TensorSpec
from kvcache.server.errors import parse_json
from kvcache.server.quota import PendingBytes
from kvcache.server.request_state import CONFIG, PRINCIPAL

HEX_KEY = re.compile(r"(?:[0-9a-fA-F]{2})+")    # bytes.fromhex alone would take "00 ff" too


def block_key(request: web.Request, text: str) -> bytes:
    """A hex block key of the request, as its tenant's stored key."""
    if not HEX_KEY.fullmatch(text):
        raise BlockFormatError(f"block keys are hex digits, two per byte, got {text[:40]!r}")
    key = bytes.fromhex(text)
    if not 1 <= len(key) <= 64:
        raise BlockFormatError(f"block keys are 1-64 bytes, got {len(key)}")
    return tenant_key(request[PRINCIPAL].tenant, key)


async def block_keys(request: web.Request) -> tuple[list[bytes], dict]:
    """A {"keys": [...]} body: the stored keys, and the body for its other fields."""
    body = await json_body(request)
    keys = body.get("keys") if isinstance(body, dict) else None
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise BlockFormatError('expected {"keys": ["<hex>", ...]}')
    if len(keys) > request.app[CONFIG].max_keys:
        raise web.HTTPRequestEntityTooLarge(max_size=request.app[CONFIG].max_keys, actual_size=len(keys),
                                            text=f"at most {request.app[CONFIG].max_keys} keys per request")
    return [block_key(request, k) for k in keys], body


def json_limit(config) -> int:
    """The largest JSON body taken: a full key list (max_keys keys of up to 64 bytes, in hex and
    quoted) and room for the rest. From the live config, so a reconfigure that raises max_keys
    raises it too (aiohttp's client_max_size is fixed when the app is built)."""
    return config.max_keys * 136 + (1 << 20)


async def json_body(request: web.Request):
    """The request's JSON body, within json_limit (413 past it); malformed JSON is a 400."""
    return parse_json(await read_at_most(request, json_limit(request.app[CONFIG])), "request body")


async def read_at_most(request: web.Request, limit: int, pending: PendingBytes | None = None) -> bytes:
    """The body, or 413 once it passes `limit` (a chunked body has no Content-Length to check
    first); 408 when it takes longer than server.request_timeout_s to arrive. With `pending`,
    each chunk is counted there before it is kept."""
    body = bytearray()
    try:
        async with asyncio.timeout(request.app[CONFIG].request_timeout_s):
            async for chunk in request.content.iter_chunked(1 << 20):
                if pending is not None:
                    pending.add(len(chunk))
                body += chunk
                if len(body) > limit:
                    raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=len(body))
    except TimeoutError:
        raise web.HTTPRequestTimeout(text="the request body took longer than server.request_timeout_s") from None
    return bytes(body)


def layout_header(header: str | None) -> tuple[TensorSpec, ...] | None:
    """X-KVCache-Layout: a JSON list of [name, dtype, shape] (shape a list of ints), or absent."""
    if not header:
        return None
    specs = parse_json(header, "X-KVCache-Layout")
    try:
        if specs is None:             # a header that is there names a layout
            raise TypeError("null is no layout")
        return wire.parse_layout(specs)
    except (ValueError, TypeError) as e:     # TensorSpec checks the names, dtypes and dims (integers)
        raise BlockFormatError(f"X-KVCache-Layout must be a JSON list of [name, dtype, [dims...]] ({e})") from None
