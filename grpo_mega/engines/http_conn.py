"""One kept-alive HTTP/1.1 connection to a rollout server, as grpo_mega.engines.client speaks to it: a request written
in one sendall, the answer's status line and headers read a line at a time and its body by its Content-Length (or
its chunks, or up to the close). None of http.client's machinery: in rollout.mode=async rank 0 sends a request per
response in flight, and http.client's header parsing (the email package's) cost the trainer's core more than the
socket did.
"""

from __future__ import annotations

import select
import socket
import ssl
from typing import Optional

MAX_LINE = 65536
MAX_HEADERS = 100


class ProtocolError(OSError):
    """An answer that is not HTTP/1.x as the client reads it (or that ended early)."""


class Connection:
    """A connection to host:port (TLS with `tls`, the system's trusted certificates), opened at the first request and
    kept open while the server keeps it."""

    def __init__(self, host: str, port: Optional[int], tls: bool, timeout: float):
        self.host, self.tls, self.timeout = host, tls, timeout
        self.port = port or (443 if tls else 80)
        self.sock: Optional[socket.socket] = None
        self._fp = None
        name = f"[{host}]" if ":" in host else host  # an IPv6 address, bracketed
        self._host_header = f"Host: {name}:{self.port}\r\n".encode("latin-1")

    def _open(self) -> None:
        sock = socket.create_connection((self.host, self.port), timeout=self.timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # the request goes out whole, at once
        if self.tls:
            sock = ssl.create_default_context().wrap_socket(sock, server_hostname=self.host)
        self.sock, self._fp = sock, sock.makefile("rb")

    def settimeout(self, timeout: float) -> None:
        self.timeout = timeout
        if self.sock is not None:
            self.sock.settimeout(timeout)

    def stale(self) -> bool:
        """Closed, or readable while idle: the server closed it (or sent bytes nobody asked for)."""
        return self.sock is None or bool(select.select([self.sock], [], [], 0)[0])

    def close(self) -> None:
        if self._fp is not None:
            self._fp.close()
        if self.sock is not None:
            self.sock.close()
        self.sock = self._fp = None

    def request(self, method: str, target: str, body: Optional[bytes], headers: dict) -> tuple[int, bytes, bool]:
        """(status, body, whether the server closes the connection after it); OSError (ProtocolError, a timeout, a
        reset) if no whole answer came."""
        if self.sock is None:
            self._open()
        head = [f"{method} {target} HTTP/1.1\r\n".encode("latin-1"), self._host_header]
        head += [f"{k}: {v}\r\n".encode("latin-1") for k, v in headers.items()]
        if body is not None:
            head.append(f"Content-Length: {len(body)}\r\n".encode("latin-1"))
        head.append(b"\r\n")
        self.sock.sendall(b"".join(head) + (body or b""))
        status, version, fields = self._head()
        while 100 <= status < 200:  # an interim answer (100 Continue): the real one follows
            status, version, fields = self._head()
        conn = fields.get(b"connection", b"").lower()
        closes = b"close" in conn or (version == b"HTTP/1.0" and b"keep-alive" not in conn)
        if method == "HEAD" or status in (204, 304):
            return status, b"", closes
        if b"chunked" in fields.get(b"transfer-encoding", b"").lower():
            return status, self._chunks(), closes
        fp, length = self._fp, fields.get(b"content-length")
        if length is None:
            return status, fp.read(), True
        if not length.isdigit():
            raise ProtocolError(f"Content-Length {length[:40]!r} is not a length")
        raw = fp.read(int(length))
        if len(raw) != int(length):
            raise ProtocolError(f"the answer's body ended after {len(raw)} of {int(length)} bytes")
        return status, raw, closes

    def _head(self) -> tuple[int, bytes, dict[bytes, bytes]]:
        """An answer's status line and headers: (status, HTTP version, lower-cased header names -> values)."""
        fp = self._fp
        line = fp.readline(MAX_LINE + 1)
        if not line:
            raise ProtocolError("the server closed the connection without answering")
        version, _, rest = line.partition(b" ")
        code = rest[:3]
        if not version.startswith(b"HTTP/1.") or not code.isdigit():
            raise ProtocolError(f"not an HTTP/1.x status line: {line[:80]!r}")
        fields: dict[bytes, bytes] = {}
        for _ in range(MAX_HEADERS + 1):
            line = fp.readline(MAX_LINE + 1)
            if line in (b"\r\n", b"\n"):
                return int(code), version, fields
            if not line or len(line) > MAX_LINE:
                raise ProtocolError("the answer's headers ended early or a line is too long")
            name, _, value = line.partition(b":")
            fields[name.strip().lower()] = value.strip()
        raise ProtocolError(f"more than {MAX_HEADERS} header lines")

    def _chunks(self) -> bytes:
        fp, parts = self._fp, []
        while True:
            line = fp.readline(MAX_LINE + 1)
            size = line.split(b";", 1)[0].strip()
            try:
                n = int(size, 16)
            except ValueError:
                raise ProtocolError(f"not a chunk size: {line[:40]!r}") from None
            if n == 0:
                while fp.readline(MAX_LINE + 1) not in (b"\r\n", b"\n", b""):  # trailers
                    pass
                return b"".join(parts)
            data = fp.read(n + 2)
            if len(data) != n + 2:
                raise ProtocolError("the answer's body ended inside a chunk")
            parts.append(data[:n])
