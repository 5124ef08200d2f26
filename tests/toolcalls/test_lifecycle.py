"""grpo_mega.toolcalls' lifecycle and isolation: each trajectory has its own instance of a tool (create with the
row's create_kwargs, call with the execute_kwargs, reward and release at its end), never shared between
samples; a worker is a new, light interpreter (no torch or Hydra), with a scrubbed environment, its own
temporary directory and a memory cap by default; a script without a `__main__` guard can use the pool."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_mega.toolcalls import Tool
from grpo_mega.toolcalls.parsers import ToolCall
from grpo_mega.toolcalls.pool import DEFAULT_MEMORY_MB, ToolPool

ROOT = Path(__file__).resolve().parents[2]


class Counter(Tool):
    """Counts its calls in the trajectory; its reward is the count, its release writes the count to a file."""

    name = "counter"

    def create(self, start: int = 0, log: str = "", **_):
        self.count, self.log = start, log

    def call(self, args, step: int = 1, **_):
        self.count += step
        return f"#{self.count}"

    def reward(self):
        return float(self.count)

    def release(self):
        if self.log:
            with open(self.log, "a") as f:
                f.write(f"{self.count}\n")


class Inspect(Tool):
    """Reports what a worker sees: its environment, working directory, memory limit and loaded modules."""

    name = "inspect"

    def call(self, args, **_):
        import resource

        return json.dumps({"env": dict(os.environ), "cwd": os.getcwd(),
                           "rlimit_as": resource.getrlimit(resource.RLIMIT_AS)[0],
                           "heavy": sorted(m for m in ("torch", "hydra", "megatron", "transformers") if m in sys.modules)})


def test_each_trajectory_has_its_own_instance(tmp_path):
    """Two trajectories interleaved on ONE worker: each counts from its own row's start (create_kwargs), steps
    by its execute_kwargs, and its reward and release see its own count alone."""
    log = tmp_path / "released.txt"
    pool = ToolPool(["tests.toolcalls.test_lifecycle:Counter"], num_workers=1)
    try:
        a = dict(create_kwargs={"start": 0, "log": str(log)}, execute_kwargs={})
        b = dict(create_kwargs={"start": 100, "log": str(log)}, execute_kwargs={"step": 10})
        out = [pool.submit(ToolCall("counter"), t, **kw).result().content
               for t, kw in (("a", a), ("b", b), ("a", a), ("b", b), ("a", a))]
        assert out == ["#1", "#110", "#2", "#120", "#3"]
        assert pool.release("a", "counter").result() == (3.0, None)
        assert pool.release("b", "counter").result() == (120.0, None)
        assert log.read_text().split() == ["3", "120"]
        assert pool.release("never", "counter").result() == (None, None)  # no instance: nothing to end
        assert pool.submit(ToolCall("counter"), "a", **a).result().content == "#1"  # released: a new instance
    finally:
        pool.close()


def test_calls_of_one_trajectory_run_in_order_on_its_worker():
    """Four workers: a trajectory's calls all reach its instance, in order, whatever the other trajectories do."""
    pool = ToolPool(["tests.toolcalls.test_lifecycle:Counter"], num_workers=4)
    try:
        futures = [(t, pool.submit(ToolCall("counter"), t)) for _ in range(5) for t in range(6)]
        got: dict = {}
        for t, f in futures:
            got.setdefault(t, []).append(f.result().content)
        assert got == {t: ["#1", "#2", "#3", "#4", "#5"] for t in range(6)}
    finally:
        pool.close()


def test_workers_are_light_scrubbed_and_capped(tmp_path, monkeypatch):
    """No torch/Hydra import in a worker (the pytest process has both), no API key or other secret in its
    environment (what rollout.multi_turn.tool_env names is kept), its own temporary directory as cwd, HOME and
    TMPDIR (removed at close), and an address-space limit by default."""
    monkeypatch.setenv("GRPO_MEGA_SERVER_API_KEY", "secret-key")
    monkeypatch.setenv("SOME_TOKEN", "t0k3n")
    monkeypatch.setenv("SEARCH_API_KEY", "wanted")
    assert "torch" in sys.modules
    pool = ToolPool(["tests.toolcalls.test_lifecycle:Inspect"], num_workers=1, env_keep=["SEARCH_API_KEY"])
    try:
        seen = json.loads(pool.run([ToolCall("inspect")])[0].content)
        stats = pool.worker_stats[0]
    finally:
        pool.close()
    env = seen["env"]
    assert "GRPO_MEGA_SERVER_API_KEY" not in env and "SOME_TOKEN" not in env and env["SEARCH_API_KEY"] == "wanted"
    assert "secret-key" not in json.dumps(env) and set(env) <= {
        "PATH", "LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE", "LC_NUMERIC", "TZ", "LD_LIBRARY_PATH", "SEARCH_API_KEY",
        "PYTHONPATH", "HOME", "TMPDIR", "TMP", "TEMP", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS",
        "PYTHONDONTWRITEBYTECODE"}
    assert seen["cwd"] == env["HOME"] == env["TMPDIR"] and seen["cwd"] != os.getcwd()
    assert os.path.basename(seen["cwd"]).startswith("grpo-mega-tool-") and not os.path.exists(seen["cwd"])
    assert seen["heavy"] == []
    assert 0 < seen["rlimit_as"] < (DEFAULT_MEMORY_MB + 1024) << 20
    assert stats["rss_mib"] < 100 and stats["start_s"] > 0  # a light interpreter (torch alone is ~300 MiB)


def test_a_script_without_main_guard_can_use_the_pool(tmp_path):
    """A plain script (no `if __name__ == "__main__"`) starting a pool: the workers are new interpreters that never
    import the script (with multiprocessing's spawn/forkserver they would, and die with EOFError); a tool
    defined in the script itself is refused with a one-line error."""
    script = tmp_path / "plain.py"
    script.write_text(
        "from grpo_mega.toolcalls import Tool\n"
        "from grpo_mega.toolcalls.parsers import ToolCall\n"
        "from grpo_mega.toolcalls.pool import ToolPool\n"
        "class Mine(Tool):\n    name = 'mine'\n    def call(self, args, **_):\n        return 'x'\n"
        "pool = ToolPool(['calculator'], num_workers=2)\n"
        "print([r.content for r in pool.run([ToolCall('calculator', {'expression': '6*7'}),"
        " ToolCall('calculator', {'expression': '1+1'})])])\n"
        "pool.close()\n"
        "try:\n    ToolPool(['__main__:Mine'])\nexcept ValueError as e:\n    print('refused:', e)\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines[0] == "['42', '2']"
    assert lines[1].startswith("refused: tool '__main__:Mine' is defined in the script being run")


class Nested(Tool):
    name = "nested"

    def call(self, args, **_):
        return {"a": [1, 2]}  # not a str


def test_unpicklable_arguments_and_non_string_results_are_answers():
    """Arguments that cannot be pickled to a worker answer with an error (nothing is sent; the worker goes on);
    a non-string result is sent as str(result) and flagged."""
    pool = ToolPool(["tests.toolcalls.test_lifecycle:Nested"], num_workers=1)
    try:
        deep: list = []
        for _ in range(5000):  # deeper than pickle can go
            deep = [deep]
        bad = pool.submit(ToolCall("nested", {"x": deep})).result()
        assert bad.error and "cannot be pickled" in bad.content
        ok = pool.submit(ToolCall("nested", {})).result()
        assert (ok.content, ok.error, ok.nonstring) == ("{'a': [1, 2]}", False, True)
        assert len(pool.started_pids) == 1
    finally:
        pool.close()


class Picky(Tool):
    name = "picky"

    def create(self, ok: bool = True, **_):
        if not ok:
            raise KeyError("no such account")

    def call(self, args, **_):
        return "fine"


def test_a_tool_that_cannot_be_built_or_created_fails_at_start_or_answers_with_an_error():
    with pytest.raises(ValueError, match="cannot import 'Missing'"):
        ToolPool(["tests.toolcalls.test_lifecycle:Missing"])
    pool = ToolPool(["tests.toolcalls.test_lifecycle:Picky"], num_workers=1)
    try:
        bad = pool.submit(ToolCall("picky"), "t", create_kwargs={"ok": False}).result()
        assert bad.error and "picky could not be created for this sample: KeyError" in bad.content
        assert pool.submit(ToolCall("picky"), "u").result().content == "fine"
    finally:
        pool.close()


class Crasher(Tool):
    name = "crasher"

    def call(self, args, **_):
        if args.get("die"):
            os._exit(3)
        return "alive"


def test_a_worker_that_crashes_or_cannot_start_answers_with_errors():
    """A worker dying mid-call answers that call with an error (the pool goes on with a new worker); a worker
    that cannot start (here: a memory cap too small to import anything) answers the waiting calls with an
    error instead of raising, and the pool recovers once workers start again."""
    pool = ToolPool(["tests.toolcalls.test_lifecycle:Crasher"], num_workers=1)
    try:
        r = pool.run([ToolCall("crasher", {"die": True})])[0]
        assert r.error and "crasher crashed (exit code 3)" in r.content
        assert pool.run([ToolCall("crasher", {})])[0].content == "alive"
        pool.run([ToolCall("crasher", {"die": True})])
        pool.max_memory_mb = 1  # the replacement cannot even import its tools
        r = pool.run([ToolCall("crasher", {})])[0]
        # the cap fails the first allocation the start makes: a MemoryError, or ENOMEM from the OS (an import's
        # listdir), named by the worker; or its report itself fails under the cap (CI once: pickling the error raised
        # MemoryError) and the pool names the exit
        assert r.error and "no tool worker could start" in r.content
        assert any(why in r.content for why in ("MemoryError", "Cannot allocate memory", "exited while starting")), \
            r.content
        pool.max_memory_mb = None
        assert pool.run([ToolCall("crasher", {})])[0].content == "alive"
    finally:
        pool.close()
