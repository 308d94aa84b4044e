"""The socket baseline of `kvcache bench daemon`'s HTTP gets: the same bytes over a loopback TCP
connection, with no protocol on top, so `http_get_vs_loopback` says what HTTP, framing and the
store cost beyond the socket itself.

    client thread                              server thread (this process)
    sendall(offset, length)  ───────────────>  recv 16 bytes
    recv_into(out) per block <───────────────  sendall(source[offset: offset + length])

The server sends straight from the benchmark's source buffer (no copy in user space); the client
receives each block into the one output buffer every get side fills, as get_many_into does. The
server is a thread, not a process: sendall and recv_into release the GIL, so both sides run on
their own core like the daemon and its client do.
"""

from __future__ import annotations

import socket
import struct
import threading

_REQUEST = struct.Struct("<QQ")


class LoopbackServer:
    """Serves ranges of `source` to one client connection; close() stops it."""

    def __init__(self, source: memoryview):
        self._source = source
        self._listen = socket.create_server(("127.0.0.1", 0))
        try:
            self.client = socket.create_connection(self._listen.getsockname())
            self._conn, _ = self._listen.accept()
        except OSError:
            self._listen.close()
            raise
        for s in (self.client, self._conn):      # as aiohttp sets it on the daemon's connections
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._thread = threading.Thread(target=self._serve, name="loopback-baseline", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        head = bytearray(_REQUEST.size)
        try:
            while _recv_exactly(self._conn, memoryview(head)):
                offset, length = _REQUEST.unpack(head)
                self._conn.sendall(self._source[offset: offset + length])
        except OSError:
            pass                      # the client went away: get() says so in the benchmark's thread

    def get(self, offset: int, size: int, n: int, out: memoryview) -> None:
        """Fetch `n` blocks of `size` bytes from `offset`, each received into `out`."""
        self.client.sendall(_REQUEST.pack(offset, size * n))
        for _ in range(n):
            if not _recv_exactly(self.client, out[:size]):
                raise RuntimeError("the loopback baseline's server closed the connection")

    def close(self) -> None:
        self.client.close()           # the server's recv sees EOF and its thread ends
        self._thread.join(10)
        self._conn.close()
        self._listen.close()


def _recv_exactly(sock: socket.socket, buf: memoryview) -> bool:
    got = 0
    while got < len(buf):
        n = sock.recv_into(buf[got:])
        if n == 0:
            return False
        got += n
    return True
