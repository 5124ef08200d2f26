"""The stand-in rollout server on a shared network (loopback only here): with an API key, every route but GET
/health refuses a request without it (401) and changes nothing; with it the server works; a bounded fuzz
campaign of malformed requests (experiments/fuzz_server.py) is refused request by request and leaves the server
healthy with the same weights and weight version. The client sends the key from the environment."""

from __future__ import annotations

import json
import os
import secrets
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from experiments import fuzz_server
from grpo_mega.processes import stop
from grpo_mega.rollout import standin_server

REPO = Path(__file__).resolve().parents[2]
KEY = secrets.token_hex(16)


@pytest.fixture(scope="module")
def server():
    env = {**os.environ, "GRPO_MEGA_SERVER_API_KEY": KEY}
    proc, url = standin_server.launch(["--model", "tiny", "--port", "0", "--vocab-size", "64", "--socket-timeout-s",
                                       str(fuzz_server.SOCKET_TIMEOUT_S)], env=env, cwd=str(REPO), timeout_s=120)
    yield url
    stop(proc)


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
    from grpo_mega.rollout.client import ServerClient

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
    from grpo_mega.rollout.client import routable_address

    assert routable_address(["http://127.0.0.1:30000", "http://localhost:30001"]) == "127.0.0.1"
