"""Forwarding HTTP proxies put between a trainer and a rollout server (SGLang's HTTP API, e.g. the stand-in) by
the experiments and the tests that strike or perturb a server: `ForwardingProxy` forwards every GET and POST to
the target and answers with the target's status and body; a subclass changes one thing through its hooks.
`NoisyProxy` perturbs the logprobs /generate returns; `WatchingProxy` counts the requests in flight per path.
(tests/rollout/test_off_policy.py's proxy kills the server on the nth /generate.) Standard library only."""

from __future__ import annotations

import json
import random
import sys
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class _Server(ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        if not isinstance(sys.exc_info()[1], ConnectionError):  # a killed client's reset is the experiment, not news
            super().handle_error(request, client_address)


class ForwardingProxy:
    """Listens on 127.0.0.1 at an ephemeral port (`url`) and forwards to `target` (`http://host:port`), each
    request with `timeout_s`; `serial=True` handles one request at a time (hooks that draw from one generator
    stay deterministic). The hooks, in the order a request meets them:
      before(handler, path) -> bool   False: the request is dropped, the connection closed unanswered
      upstream(method, path, body)    the target's (status, body); an HTTP error status is passed on
      after(path, code, data) -> bytes   the body sent back
    A client gone before its answer is written closes its connection and nothing else."""

    def __init__(self, target: str, timeout_s: float = 300.0, serial: bool = False):
        self.target, self.timeout_s = target, timeout_s
        self.lock = threading.Lock()
        self._serial = serial
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _forward(self, body):
                if proxy._serial:
                    with proxy.lock:
                        answer = proxy._answer(self, body)
                else:
                    answer = proxy._answer(self, body)
                if answer is None:
                    self.close_connection = True
                    return
                code, data = answer
                try:
                    self.send_response(code)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:  # the client that asked is gone (a trainer killed mid-request)
                    self.close_connection = True

            def do_GET(self):
                self._forward(None)

            def do_POST(self):
                self._forward(self.rfile.read(int(self.headers.get("Content-Length") or 0)))

            def log_message(self, fmt, *args):
                pass

        self.httpd = _Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def _answer(self, handler: BaseHTTPRequestHandler, body: bytes | None) -> tuple[int, bytes] | None:
        if not self.before(handler, handler.path):
            return None
        code, data = self.upstream(handler.command, handler.path, body)
        return code, self.after(handler.path, code, data)

    def before(self, handler: BaseHTTPRequestHandler, path: str) -> bool:
        return True

    def upstream(self, method: str, path: str, body: bytes | None) -> tuple[int, bytes]:
        req = urllib.request.Request(self.target + path, data=body, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def after(self, path: str, code: int, data: bytes) -> bytes:
        return data

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class NoisyProxy(ForwardingProxy):
    """A deliberately perturbed rollout engine: Gaussian noise N(0, sigma^2) added to every logprob /generate
    returns, everything else (weight updates included) forwarded unchanged. The samples are the server's; only
    the engine's reported logprobs drift from the trainer's, as with other kernels or precision. Deterministic:
    one seeded generator, requests handled one at a time. `perturbed` counts the logprobs changed so far."""

    def __init__(self, target: str, sigma: float, seed: int = 0):
        self.sigma, self.rng, self.perturbed = sigma, random.Random(seed), 0
        super().__init__(target, timeout_s=300.0, serial=True)

    def after(self, path: str, code: int, data: bytes) -> bytes:
        if path != "/generate" or code != 200:
            return data
        outs = json.loads(data)
        for o in outs:
            for x in o["meta_info"]["output_token_logprobs"]:
                x[0] = float(x[0]) + self.rng.gauss(0.0, self.sigma)
                self.perturbed += 1
        return json.dumps(outs).encode()


class WatchingProxy(ForwardingProxy):
    """Counts, per path, the requests in flight to the target (`busy(path)`)."""

    def __init__(self, target: str):
        self.in_flight: dict[str, int] = {}
        super().__init__(target, timeout_s=600.0)

    def upstream(self, method: str, path: str, body: bytes | None) -> tuple[int, bytes]:
        with self.lock:
            self.in_flight[path] = self.in_flight.get(path, 0) + 1
        try:
            return super().upstream(method, path, body)
        finally:
            with self.lock:
                self.in_flight[path] -= 1

    def busy(self, path: str) -> bool:
        with self.lock:
            return self.in_flight.get(path, 0) > 0
