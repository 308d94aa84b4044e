"""HTTP/1.1 request heads as the daemon's front (server/front/connection.py) reads them, and the heads of
the replies it and the upload threads (server/front/bulk_put.py) write themselves.

Only plain heads are parsed here: every line ends in CRLF and holds no other CR, LF or NUL.
Anything else (bare-LF line endings, `X-A: b\nTransfer-Encoding: chunked`) goes to aiohttp,
whose parser answers it, so that the two never read one head two ways."""

from __future__ import annotations

from dataclasses import dataclass
from http import HTTPStatus

WINDOW = 4096      # one recv of a head or of frame headers (a small one: payloads go elsewhere)
LINGER_S = 2.0     # an error reply with a body left unread: the connection drops what still comes this long
NOT_PLAIN = 0      # head_end(): a blank line ends a head that is not plain CRLF (aiohttp's to answer)


@dataclass
class Head:
    method: str
    target: str
    version: str
    headers: dict[str, str]
    size: int                  # bytes of the head, blank line included


def head_end(buf: bytes | bytearray, start: int = 0, end: int | None = None) -> int:
    """Where the head in buf[start:end] ends (past its blank line); -1 while none has ended;
    NOT_PLAIN when a blank line shows it does not end in CRLF CRLF (it never will: aiohttp takes
    it now, not at the header timeout). The first LF CRLF or LF LF is the first blank line."""
    end = len(buf) if end is None else end
    ends = [at for at in (buf.find(b"\n\r\n", start, end), buf.find(b"\n\n", start, end)) if at >= 0]
    if not ends:
        return -1
    at = min(ends)
    return at + 3 if at > start and buf[at - 1: at + 3] == b"\r\n\r\n" else NOT_PLAIN


def parse_head(raw: bytes) -> Head | None:
    """The request line and headers (names lowercased); None when malformed or ambiguous, so
    that aiohttp, which answers such requests properly, gets them."""
    try:
        text = raw.decode("latin-1")
    except UnicodeDecodeError:
        return None
    lines = text.split("\r\n")
    if any(c in line for line in lines for c in "\r\n\0"):    # a bare CR or LF, or a NUL, inside a line
        return None
    parts = lines[0].split(" ")
    if len(parts) != 3:
        return None
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            break
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():   # "Content-Length : 5": aiohttp refuses it too
            return None
        name = name.lower()
        if name in headers and name in ("content-length", "host"):
            return None
        headers[name] = value.strip()
    return Head(parts[0], parts[1], parts[2], headers, len(raw))


def reply_head(status: int, length: int, close: bool) -> bytes:
    return (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\nContent-Type: application/json; charset=utf-8\r\n"
            f"Content-Length: {length}\r\n" + ("Connection: close\r\n" if close else "") + "\r\n").encode()
