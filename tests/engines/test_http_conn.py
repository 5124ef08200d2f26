"""grpo_mega.engines.http_conn against answers written byte by byte (a chunked body, an interim 100, a close,
HTTP/1.0, a body that ends early, a non-HTTP answer) and against http.server's handler on one kept-alive
connection."""

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from grpo_mega.engines.http_conn import Connection, ProtocolError


def _answering(*answers: bytes, host: str = "127.0.0.1"):
    """A listening socket on `host` whose first connection gets `answers`, one per request read (then it is
    closed); returns (port, the requests' bytes as read, the thread)."""
    srv = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    srv.bind((host, 0))
    srv.listen(1)
    seen: list[bytes] = []

    def serve():
        conn, _ = srv.accept()
        with conn:
            for answer in answers:
                data = b""
                while b"\r\n\r\n" not in data:
                    data += conn.recv(65536)
                head, _, body = data.partition(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                while len(body) < length:
                    body += conn.recv(65536)
                seen.append(head + b"\r\n\r\n" + body)
                conn.sendall(answer)
        srv.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return srv.getsockname()[1], seen, t


def test_a_request_and_answers_of_each_framing():
    answers = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 7\r\n\r\n{\"a\":1}",
               b"HTTP/1.1 201 Created\r\nTransfer-Encoding: chunked\r\n\r\n4;ext=1\r\n[1, \r\n3\r\n2]\n\r\n0\r\nX-T: 1\r\n\r\n",
               b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n",  # an interim answer first
               b"HTTP/1.1 500 Oops\r\nconnection: Close\r\ncontent-length: 2\r\n\r\nno")
    port, seen, t = _answering(*answers)
    conn = Connection("127.0.0.1", port, False, timeout=10)
    assert conn.request("POST", "/generate", b'{"x": 1}', {"Content-Type": "application/json"}) == (200, b'{"a":1}',
                                                                                                     False)
    assert seen[0] == (f"POST /generate HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
                       "Content-Length: 8\r\n\r\n{\"x\": 1}").encode()
    status, body, closes = conn.request("GET", "/health", None, {})
    assert (status, json.loads(body), closes) == (201, [1, 2], False)
    assert seen[1] == f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode()
    assert conn.request("GET", "/x", None, {}) == (204, b"", False)
    assert conn.request("GET", "/y", None, {}) == (500, b"no", True)  # the same connection all along
    conn.close()
    t.join(10)


@pytest.mark.parametrize("answer,what", [
    (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort", "ended after 5 of 10 bytes"),
    (b"SSH-2.0-OpenSSH_9.2\r\n\r\n", "not an HTTP/1.x status line"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: ten\r\n\r\n", "is not a length"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "not a chunk size"),
    (b"", "closed the connection without answering"),
])
def test_a_broken_answer_is_an_oserror_naming_it(answer, what):
    port, _, t = _answering(answer)
    conn = Connection("127.0.0.1", port, False, timeout=10)
    with pytest.raises(ProtocolError, match=what):
        conn.request("GET", "/health", None, {})
    conn.close()
    t.join(10)


def test_an_ipv6_host_is_bracketed_in_the_host_header():
    port, seen, t = _answering(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}", host="::1")
    conn = Connection("::1", port, False, timeout=10)
    assert conn.request("GET", "/health", None, {}) == (200, b"{}", False)
    assert seen[0].split(b"\r\n")[1] == f"Host: [::1]:{port}".encode()
    conn.close()
    t.join(10)


def test_http10_without_length_reads_to_the_close():
    port, _, t = _answering(b"HTTP/1.0 200 OK\r\n\r\nall of it")
    conn = Connection("127.0.0.1", port, False, timeout=10)
    assert conn.request("GET", "/", None, {}) == (200, b"all of it", True)
    conn.close()
    t.join(10)


def test_kept_alive_with_http_server_and_stale_once_it_closes():
    class Echo(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            out = json.dumps({"got": json.loads(body), "auth": self.headers.get("Authorization"),
                              "port": self.client_address[1]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(out)))
            if self.path == "/last":
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Echo)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        conn = Connection("127.0.0.1", server.server_address[1], False, timeout=10)
        ports = set()
        for i in range(3):
            status, body, closes = conn.request("POST", "/generate", json.dumps([i]).encode(),
                                                {"Authorization": "Bearer k"})
            out = json.loads(body)
            assert (status, out["got"], out["auth"], closes) == (200, [i], "Bearer k", False)
            ports.add(out["port"])
            assert not conn.stale()
        assert len(ports) == 1  # one connection, kept alive
        status, _, closes = conn.request("POST", "/last", b"[]", {})
        assert (status, closes) == (200, True)
        for _ in range(1000):  # the server's close arrives (10 s at most)
            if conn.stale():
                break
            time.sleep(0.01)
        assert conn.stale()
        conn.close()
        assert conn.stale()
    finally:
        server.shutdown()
        server.server_close()
