"""The stand-in rollout server on a shared network (loopback only here): with an API key, every route but GET
/health refuses a request without it (401) and changes nothing; with it the server works; a bounded fuzz
campaign of malformed requests (experiments/fuzz_server.py) is refused request by request and leaves the server
healthy with the same weights and weight version. The client sends the key from the environment."""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from experiments import fuzz_server
from grpo_mega.processes import stop
from grpo_mega.engines import standin_server

REPO = Path(__file__).resolve().parents[2]
KEY = secrets.token_hex(16)


@pytest.fixture(scope="module")
def started():
    env = {**os.environ, "GRPO_MEGA_SERVER_API_KEY": KEY}
    proc, url = standin_server.launch(["--model", "tiny", "--port", "0", "--vocab-size", "64", "--socket-timeout-s",
                                       str(fuzz_server.SOCKET_TIMEOUT_S)], env=env, cwd=str(REPO), timeout_s=120)
    yield proc, url
    stop(proc)


@pytest.fixture(scope="module")
def server(started):
    return started[1]


def _call(url, path, body=None, key=None):
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(url + path, data=None if body is None else json.dumps(body).encode(),
                                 method="GET" if body is None else "POST", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def test_without_the_key_every_route_but_health_is_refused_and_nothing_changes(server):
    before = fuzz_server.state(server, KEY)
    assert _call(server, "/health")[0] == 200
    for path in fuzz_server.MUTATING:
        for key in (None, "not-the-key"):
            status, _ = _call(server, path, {"new_version": 999, "input_ids": [[1, 2]]}, key=key)
            assert status == 401, (path, key, status)
    assert "GRPO_MEGA_SERVER_API_KEY" in _call(server, "/generate", {})[1]  # the 401 says which key it wants
    assert _call(server, "/model_info")[0] == 401
    assert fuzz_server.state(server, KEY) == before  # weights and weight version untouched


def test_with_the_key_it_serves(server, monkeypatch):
    status, out = _call(server, "/generate", {"input_ids": [[1, 2, 3]], "return_logprob": True,
                                              "sampling_params": {"max_new_tokens": 4, "sampling_seed": 1}}, key=KEY)
    assert status == 200 and 1 <= len(out[0]["output_ids"]) <= 4
    monkeypatch.setenv("GRPO_MEGA_SERVER_API_KEY", KEY)
    from grpo_mega.engines.client import ServerClient

    client = ServerClient([server], timeout_s=30)  # its start-up health check, then a keyed generate
    gen = client.generate([[1, 2, 3]], 2, 1.0, 1.0, 3, [], 0)
    assert len(gen.token_ids) == 2 and all(len(t) == len(lp) for t, lp in zip(gen.token_ids, gen.logprobs))


def test_a_fuzz_campaign_leaves_the_server_healthy_and_unchanged(server):
    result = fuzz_server.campaign(server, KEY, count=150, seed=1, vocab=64)
    assert result["accepted"] == [], result["accepted"]
    assert result["healthy_after"] and result["weights_unchanged"] and result["version_unchanged"]
    statuses = {s for c in result["by_kind"].values() for s in c["statuses"]}
    assert statuses <= {"400", "401", "408", "413"}, statuses  # every one refused with a reason, none dropped unanswered
    assert sum(c["sent"] for c in result["by_kind"].values()) == 150 and len(result["by_kind"]) >= 15
    assert result["by_kind"]["body_stalled"] == {"sent": 3, "statuses": {"408": 3}}  # the socket timeout ended them
    assert set(result["by_kind"]["json_nested_too_deep"]["statuses"]) <= {"400", "401"}  # not a dropped connection


def test_the_client_names_a_routable_address_for_the_update_group():
    from grpo_mega.engines.client import routable_address

    assert routable_address(["http://127.0.0.1:30000", "http://localhost:30001"]) == "127.0.0.1"


def test_without_a_key_it_will_not_serve_beyond_loopback():
    """Every route (weight updates included) would be open to the network: refused at start-up, in one line."""
    env = {k: v for k, v in os.environ.items() if k != "GRPO_MEGA_SERVER_API_KEY"}
    proc = subprocess.run([sys.executable, "-m", "grpo_mega.engines.standin_server", "--model", "tiny", "--host",
                           "0.0.0.0", "--port", "0"], env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "error: --host 0.0.0.0 without an API key would open every route (weight updates included) to the network: "
        "set the key in the environment (--api-key-env, default GRPO_MEGA_SERVER_API_KEY), or bind to 127.0.0.1"]
    for host in ("127.0.0.1", "localhost", "::1"):
        standin_server.check_bind(host, "")  # loopback without a key is fine
    standin_server.check_bind("0.0.0.0", "a-key")


def test_a_number_too_long_to_convert_is_answered_400(server):
    """Python refuses to convert an integer of over 4,300 digits (ValueError, not JSONDecodeError): the server
    answers that request 400 rather than dropping its connection."""
    body = b'{"input_ids": [[1' + b"9" * 5000 + b']], "return_logprob": true}'
    req = urllib.request.Request(server + "/generate", data=body, method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 400 and "Exceeds the limit" in e.value.read().decode()
    assert _call(server, "/health")[0] == 200


def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def test_half_sent_requests_do_not_make_a_thread_each(started):
    """200 connections that send half a request line and wait: at most standin_server.THREADS serve (the others
    wait, or beyond MAX_PENDING are closed at once), never a thread per connection; once they time out (the
    server's socket timeout) the server answers again."""
    proc, url = started
    host, port = url.split("//")[1].split(":")
    base = _threads(proc.pid)
    conns = []
    try:
        for _ in range(200):
            c = socket.create_connection((host, int(port)), timeout=10)
            c.sendall(b"POST /generate HTTP/1.1\r\nContent-Le")
            conns.append(c)
        time.sleep(0.5)
        assert _threads(proc.pid) <= base + standin_server.THREADS, (base, _threads(proc.pid))
    finally:
        for c in conns:
            c.close()
    # The pool drains the closed connections a few at a time; until it has, a new one may find every slot taken and
    # be closed unanswered (by design). Recovery is the claim: /health answers within the deadline.
    deadline, last = time.monotonic() + 30, None
    while time.monotonic() < deadline:
        try:
            last = _call(url, "/health")[0]
            break
        except (ConnectionError, urllib.error.URLError) as e:  # RemoteDisconnected is a ConnectionError
            last = repr(e)
            time.sleep(0.2)
    assert last == 200, last
