"""A deliberately perturbed rollout engine: an HTTP proxy in front of a rollout server (SGLang's API, e.g. the
stand-in) that adds Gaussian noise N(0, sigma^2) to every logprob /generate returns, and forwards everything
else unchanged (weight updates included). The samples are the server's; only the engine's reported logprobs
drift from the trainer's, as with other kernels or precision. Deterministic: one seeded generator, requests
handled one at a time."""

from __future__ import annotations

import json
import random
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class NoisyProxy:
    def __init__(self, target: str, sigma: float, seed: int = 0):
        self.target, self.sigma, self.rng, self.lock = target, sigma, random.Random(seed), threading.Lock()
        self.perturbed = 0  # logprobs changed so far
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _forward(self, body):
                with proxy.lock:
                    req = urllib.request.Request(proxy.target + self.path, data=body, method=self.command,
                                                 headers={"Content-Type": "application/json"})
                    try:
                        with urllib.request.urlopen(req, timeout=300) as resp:
                            code, data = resp.status, resp.read()
                    except urllib.error.HTTPError as e:
                        code, data = e.code, e.read()
                    if self.path == "/generate" and code == 200:
                        data = proxy._perturb(data)
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._forward(None)

            def do_POST(self):
                self._forward(self.rfile.read(int(self.headers.get("Content-Length") or 0)))

            def log_message(self, fmt, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def _perturb(self, data: bytes) -> bytes:
        outs = json.loads(data)
        for o in outs:
            for x in o["meta_info"]["output_token_logprobs"]:
                x[0] = float(x[0]) + self.rng.gauss(0.0, self.sigma)
                self.perturbed += 1
        return json.dumps(outs).encode()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
