"""A bounded fuzz campaign against the rollout stand-in server (grpo_mega/engines/standin_server.py): a fixed
count of malformed requests (bad and lying Content-Lengths, truncated and non-JSON bodies, wrong types, token ids
out of range, huge batches and max_new_tokens, weight buckets with unknown names, huge shapes and wrong dtypes,
requests without the API key, JSON nested too deep, bodies that stall), then checks the server still answers
/health and holds the same weights and weight version. Writes the counts to bench_results/server_fuzz.json.

    python -m experiments.fuzz_server [--count 400] [--out bench_results/server_fuzz.json]

The server runs on 127.0.0.1 only, with a key of this run's own.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import secrets
import socket
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

REPO = Path(__file__).resolve().parents[1]
MUTATING = ["/generate", "/init_weights_update_group", "/update_weights_from_distributed", "/update_weight_version",
            "/flush_cache", "/begin_weight_update", "/end_weight_update", "/grpo_mega/weight_checksums"]


STALL_EVERY = 50
"""One request in this many stalls: part of its body, then nothing (the server's socket timeout must end it)."""
SOCKET_TIMEOUT_S = 2.0
"""The server's --socket-timeout-s in the campaign (a stalled request costs this long)."""


def _raw(url: str, request: bytes, timeout: float = 10.0, stall: bool = False) -> int:
    """Send raw bytes, half-close (or, `stall`ing, keep the connection open and send nothing more), return the
    HTTP status (0: no answer, the connection closed or timed out)."""
    u = urlparse(url)
    with socket.create_connection((u.hostname, u.port), timeout=timeout) as s:
        s.sendall(request)
        if not stall:
            s.shutdown(socket.SHUT_WR)
        try:
            head = s.recv(64)
        except OSError:
            return 0
    try:
        return int(head.split(b" ")[1])
    except (IndexError, ValueError):
        return 0


def _post(url: str, path: str, body: bytes, key: str, length=None, stall: bool = False) -> int:
    length = len(body) if length is None else length
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    return _raw(url, (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{auth}"
                      f"Content-Length: {length}\r\nConnection: close\r\n\r\n").encode() + body, stall=stall)


def cases(rng: random.Random, vocab: int, names: list[str], key: str):
    """(kind, thunk returning (url -> status)) for one malformed request, drawn at random."""
    j = lambda o: json.dumps(o).encode()  # noqa: E731
    kinds = {
        "no_key": lambda u: _post(u, rng.choice(MUTATING), j({"new_version": 999}), ""),
        "wrong_key": lambda u: _post(u, "/update_weight_version", j({"new_version": 999}), "x" * 64),
        "length_not_a_number": lambda u: _post(u, "/generate", b"{}", key, length="12abc"),
        "length_negative": lambda u: _post(u, "/generate", b"{}", key, length=-5),
        "length_huge": lambda u: _post(u, "/generate", b"{}", key, length=1 << 40),
        "body_truncated": lambda u: _post(u, "/generate", j({"input_ids": [[1, 2, 3]]})[:7], key, length=40),
        "body_not_json": lambda u: _post(u, rng.choice(MUTATING), bytes(rng.randrange(256) for _ in range(64)), key),
        "json_nested_too_deep": lambda u: _post(u, rng.choice(MUTATING), b"[" * 100_000 + b"]" * 100_000, key),
        "body_not_an_object": lambda u: _post(u, "/generate", j([1, 2, 3]), key),
        "ids_out_of_range": lambda u: _post(u, "/generate", j({"input_ids": [[vocab + rng.randrange(10 ** 6)]]}), key),
        "ids_negative": lambda u: _post(u, "/generate", j({"input_ids": [[-1, 2]]}), key),
        "ids_wrong_type": lambda u: _post(u, "/generate", j({"input_ids": [["a", None]]}), key),
        "batch_huge": lambda u: _post(u, "/generate", j({"input_ids": [[1]] * 5000}), key),
        "max_new_tokens_huge": lambda u: _post(u, "/generate", j({"input_ids": [[1]],
                                                                   "sampling_params": {"max_new_tokens": 10 ** 9}}), key),
        "bucket_unknown_name": lambda u: _post(u, "/update_weights_from_distributed", j(
            {"load_format": "flattened_bucket", "names": ["evil.weight"], "dtypes": ["float32"], "shapes": [[4]]}), key),
        "bucket_huge_shape": lambda u: _post(u, "/update_weights_from_distributed", j(
            {"load_format": "flattened_bucket", "names": [rng.choice(names)], "dtypes": ["float32"],
             "shapes": [[1 << 20, 1 << 20]]}), key),
        "bucket_wrong_dtype": lambda u: _post(u, "/update_weights_from_distributed", j(
            {"load_format": "flattened_bucket", "names": [rng.choice(names)], "dtypes": ["complex128"],
             "shapes": [[1]]}), key),
        "bucket_half_bad": lambda u: _post(u, "/update_weights_from_distributed", j(
            {"load_format": "flattened_bucket", "names": [names[0], "evil"], "dtypes": ["float32"] * 2,
             "shapes": [[1], [1]]}), key),
        "version_not_a_number": lambda u: _post(u, "/update_weight_version", j({"new_version": "999; rm"}), key),
    }
    kind = rng.choice(sorted(kinds))
    return kind, kinds[kind]


def state(url: str, key: str) -> tuple:
    """(weight checksums, weight version) as the server reports them."""
    def call(path, body=None):
        req = http.client.HTTPConnection(urlparse(url).hostname, urlparse(url).port, timeout=30)
        req.request("POST" if body is not None else "GET", path, body=None if body is None else json.dumps(body),
                    headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
        out = json.loads(req.getresponse().read())
        req.close()
        return out
    return call("/grpo_mega/weight_checksums", {}), call("/model_info")["weight_version"]


def campaign(url: str, key: str, count: int, seed: int = 0, vocab: int = 64) -> dict:
    """`count` malformed requests; the server's health, weights and version before and after."""
    rng = random.Random(seed)
    before = state(url, key)
    names = sorted(before[0])
    counts: dict[str, dict] = {}
    accepted = []
    t0 = time.monotonic()
    for i in range(count):
        kind, send = cases(rng, vocab, names, key)
        if i % STALL_EVERY == STALL_EVERY - 1:  # 10 of 100 promised bytes, then silence: a 408 after the timeout
            kind, send = "body_stalled", lambda u: _post(u, "/update_weight_version", b'{"new_vers', key, length=100,
                                                          stall=True)
        status = send(url)
        c = counts.setdefault(kind, {"sent": 0, "statuses": {}})
        c["sent"] += 1
        c["statuses"][str(status)] = c["statuses"].get(str(status), 0) + 1
        if 200 <= status < 300:
            accepted.append(kind)
    after = state(url, key)
    conn = http.client.HTTPConnection(urlparse(url).hostname, urlparse(url).port, timeout=10)
    conn.request("GET", "/health")
    healthy = conn.getresponse().status == 200
    conn.close()
    return dict(requests=count, seconds=round(time.monotonic() - t0, 2), by_kind=counts, accepted=accepted,
                healthy_after=healthy, weights_unchanged=before[0] == after[0],
                version_unchanged=before[1] == after[1], weight_version=after[1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(REPO / "bench_results" / "server_fuzz.json"))
    args = ap.parse_args(argv)
    from grpo_mega.processes import stop
    from grpo_mega.engines import standin_server

    key = secrets.token_hex(16)
    env = {**os.environ, "GRPO_MEGA_SERVER_API_KEY": key, "PYTHONPATH": str(REPO)}
    proc, url = standin_server.launch(["--model", "tiny", "--port", "0", "--vocab-size", "64",
                                       "--socket-timeout-s", str(SOCKET_TIMEOUT_S)], env=env, cwd=str(REPO))
    try:
        result = campaign(url, key, args.count, args.seed, vocab=64)
    finally:
        stop(proc)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "by_kind"}))
    return 0 if result["healthy_after"] and result["weights_unchanged"] and not result["accepted"] else 1


if __name__ == "__main__":
    sys.exit(main())
