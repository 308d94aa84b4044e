"""The blocking HTTP path of KVClient (client/blocking_http.py): vectored sends that resume
after partial writes, pooled connections the server closed, error mapping, no retry of errors
raised by the caller's handler."""

import json
import socket
import threading

import pytest

from kvcache.client.blocking_http import BlockingHTTP, send_pieces
from kvcache.client.async_client import DaemonError, QuotaExceededError


def test_send_pieces_resumes_partial_sends_in_order():
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)      # forces many partial sendmsg calls
    pieces = [bytes([i % 256]) * (1 + 7919 * i % 50_000) for i in range(300)] + [b"", memoryview(b"end")]
    want = b"".join(bytes(p) for p in pieces)
    got = bytearray()

    def drain():
        while len(got) < len(want):
            got.extend(b.recv(1 << 16))
    t = threading.Thread(target=drain)
    t.start()
    send_pieces(a, pieces)
    t.join(timeout=10)
    assert bytes(got) == want
    a.close()
    b.close()


class OneShotServer:
    """Answers each connection's first request, then closes it without saying so (no
    `Connection: close`): the client's pooled connection is stale on its next use."""

    def __init__(self, status: int = 200, body: dict | bytes | None = None):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port, self.connections, self.requests = self.sock.getsockname()[1], 0, []
        self.status, self.body = status, body or {"ok": True}
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    data += conn.recv(65536)
                head, _, rest = data.partition(b"\r\n\r\n")
                length = int([ln.split(b":")[1] for ln in head.split(b"\r\n")
                              if ln.lower().startswith(b"content-length")][0])
                while len(rest) < length:
                    rest += conn.recv(65536)
                self.requests.append(rest)
                body = self.body if isinstance(self.body, bytes) else json.dumps(self.body).encode()
                conn.sendall(f"HTTP/1.1 {self.status} X\r\nContent-Type: application/json\r\n"
                             f"Content-Length: {len(body)}\r\n\r\n".encode() + body)

    def close(self) -> None:
        self.sock.close()


def http(port: int, retries: int = 0) -> BlockingHTTP:
    return BlockingHTTP(f"http://127.0.0.1:{port}", None, {"Authorization": "Bearer t"}, timeout_s=5,
                        pool_size=4, retries=retries, backoff=lambda attempt: 0.001)


def test_a_pooled_connection_the_server_closed_is_retried_once_at_no_cost():
    srv = OneShotServer()
    h = http(srv.port, retries=0)
    read = lambda resp: json.loads(resp.read())   # noqa: E731
    assert h.request("POST", "/x", [b"ab", memoryview(b"cd")], {"Content-Length": "4"}, read) == {"ok": True}
    assert h.request("POST", "/x", [b"efgh"], {"Content-Length": "4"}, read) == {"ok": True}
    assert srv.requests == [b"abcd", b"efgh"] and srv.connections == 2
    h.close()
    srv.close()


def test_error_replies_map_onto_store_errors_and_handler_errors_are_not_retried():
    srv = OneShotServer(507, {"error": "quota_exceeded", "message": "tenant t is full"})
    h = http(srv.port, retries=3)
    with pytest.raises(QuotaExceededError) as e:
        h.request("POST", "/v1/blocks/batch_put", [b"x"], {"Content-Length": "1"}, lambda resp: None)
    assert e.value.status == 507 and "tenant t is full" in str(e.value) and srv.connections == 1
    srv.status, srv.body = 200, {"ok": True}

    def bad(resp):
        raise ValueError("output buffer too small")
    with pytest.raises(ValueError):
        h.request("POST", "/x", [b"x"], {"Content-Length": "1"}, bad)
    assert srv.connections == 2                                        # raised once, never retried
    srv.close()


def test_unreachable_daemon_is_a_daemon_error_after_the_retries():
    s = socket.create_server(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with pytest.raises(DaemonError, match="after 3 attempt"):
        http(port, retries=2).request("POST", "/x", [b"x"], {"Content-Length": "1"}, lambda resp: None)

