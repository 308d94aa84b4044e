"""HTTP/1.1 request heads as the daemon's front (cli/http_front.py) reads them, and the heads of
the replies it and the upload threads (cli/bulk_put.py) write themselves."""

from __future__ import annotations

from dataclasses import dataclass
from http import HTTPStatus


@dataclass
class Head:
    method: str
    target: str
    version: str
    headers: dict[str, str]
    size: int                  # bytes of the head, blank line included


def parse_head(raw: bytes) -> Head | None:
    """The request line and headers (names lowercased); None when malformed or ambiguous, so
    that aiohttp, which answers such requests properly, gets them."""
    try:
        text = raw.decode("latin-1")
    except UnicodeDecodeError:
        return None
    lines = text.split("\r\n")
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
