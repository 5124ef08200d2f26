"""grpo_mega.toolcalls: the calculator (no eval), the registry, the Hermes parser, and the worker pool's handling
of raising, slow and malformed calls (each an error turn, the pool goes on)."""

import os
import time

import psutil
import pytest

from grpo_mega.toolcalls import Tool, ToolError, build_tool, build_tools, evaluate_arithmetic
from grpo_mega.toolcalls.parsers import PARSERS, ToolCall
from grpo_mega.toolcalls.pool import ToolPool


class Sleeper(Tool):
    name = "sleeper"
    parameters = {"type": "object", "properties": {"s": {"type": "number"}}}

    def call(self, args):
        import subprocess

        if args.get("child"):  # a grandchild that must die with the worker
            p = subprocess.Popen(["sleep", "60"])
            with open(args["child"], "w") as f:
                f.write(str(p.pid))
        time.sleep(float(args["s"]))
        return "slept"


class Raiser(Tool):
    name = "raiser"

    def call(self, args):
        raise RuntimeError("boom")


class Hungry(Tool):
    name = "hungry"
    description = "allocates `mb` MiB and answers with its size"

    def call(self, args):
        return str(len(bytearray(int(args["mb"]) << 20)) >> 20)


def test_calculator_arithmetic_without_eval():
    assert evaluate_arithmetic("12*(3+4)") == 84
    assert evaluate_arithmetic("7/2") == 3.5
    assert evaluate_arithmetic("-2**3 + 10 % 4") == -6
    for bad in ("__import__('os').system('true')", "x + 1", "2**1000", "1/0", "(1,2)", "'a'*3", "1 +"):
        with pytest.raises(ToolError):
            evaluate_arithmetic(bad)
    assert build_tool("calculator").call({"expression": "99+1"}) == "100"
    with pytest.raises(ToolError, match="exactly one argument"):
        build_tool("calculator").call({"expr": "1"})


def test_registry_and_dotted_path():
    with pytest.raises(ValueError, match="unknown tool 'calc'; valid: calculator"):
        build_tool("calc")
    tools = build_tools(["calculator", "tests.toolcalls.test_toolcalls:Sleeper"])
    assert sorted(tools) == ["calculator", "sleeper"]
    assert tools["calculator"].schema()["function"]["parameters"]["required"] == ["expression"]
    with pytest.raises(ValueError, match="two tools"):
        build_tools(["calculator", "calculator"])
    with pytest.raises(ValueError, match="cannot import"):
        build_tool("tests.toolcalls.test_toolcalls:Nope")


def test_hermes_parser():
    p = PARSERS.get("hermes")
    text = ('think <tool_call>\n{"name": "calculator", "arguments": {"expression": "1+2"}}\n</tool_call>'
            '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"3\\"}"}</tool_call>'
            '<tool_call>{"name": oops}</tool_call><tool_call>{"name": "c", "arguments": [1]}</tool_call>')
    calls = p(text)
    assert calls[0] == ToolCall("calculator", {"expression": "1+2"})
    assert calls[1] == ToolCall("calculator", {"expression": "3"})
    assert calls[2].error and "not valid JSON" in calls[2].error
    assert calls[3].error and "JSON object" in calls[3].error
    assert p("no call here") == []
    with pytest.raises(ValueError, match="valid: bare, expression, hermes, qwen"):
        PARSERS.get("xml")


def test_pool_errors_timeouts_and_kill(tmp_path):
    pool = ToolPool(["calculator", "tests.toolcalls.test_toolcalls:Sleeper", "tests.toolcalls.test_toolcalls:Raiser"],
                    num_workers=2, timeout_s=1.0, start_method="fork")
    try:
        child_file = tmp_path / "child.pid"
        t0 = time.monotonic()
        res = pool.run([ToolCall("calculator", {"expression": "6*7"}),
                        ToolCall("sleeper", {"s": 30, "child": str(child_file)}),
                        ToolCall("raiser"), ToolCall("nope"), ToolCall("", error="bad json"),
                        ToolCall("calculator", {"expression": "1/0"})])
        assert time.monotonic() - t0 < 10
        assert (res[0].content, res[0].error) == ("42", False)
        assert res[1].timeout and res[1].error and "timed out after 1 s" in res[1].content
        assert res[2].error and "RuntimeError: boom" in res[2].content
        assert res[3].error and "unknown tool 'nope'; valid: calculator, raiser, sleeper" in res[3].content
        assert res[4].content == "Error: bad json"
        assert res[5].error and "division by zero" in res[5].content
        grandchild = int(child_file.read_text())
        time.sleep(0.2)
        assert not psutil.pid_exists(grandchild) or psutil.Process(grandchild).status() == psutil.STATUS_ZOMBIE
        assert pool.run([ToolCall("calculator", {"expression": "2+2"})])[0].content == "4"  # the pool goes on
    finally:
        pool.close()
    time.sleep(0.2)
    for pid in pool.started_pids:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, pid


def test_an_idle_tool_worker_killed_from_outside_is_replaced():
    import signal

    pool = ToolPool(["calculator"], num_workers=1, timeout_s=10.0, start_method="fork")
    try:
        assert pool.run([ToolCall("calculator", {"expression": "1+1"})])[0].content == "2"
        victim = pool.started_pids[0]
        os.kill(victim, signal.SIGKILL)  # by its PID, while it waits for a call
        time.sleep(0.2)
        res = pool.run([ToolCall("calculator", {"expression": "6*7"}), ToolCall("calculator", {"expression": "2+3"})])
        assert [(r.content, r.error) for r in res] == [("42", False), ("5", False)]  # nothing failed
        assert len(pool.started_pids) == 2 and victim not in [w.proc.pid for w in pool._workers]
    finally:
        pool.close()


def test_a_tool_call_over_the_memory_limit_fails_alone():
    pool = ToolPool(["tests.toolcalls.test_toolcalls:Hungry"], num_workers=1, timeout_s=20.0, start_method="fork",
                    max_memory_mb=256)
    try:
        res = pool.run([ToolCall("hungry", {"mb": 8}), ToolCall("hungry", {"mb": 4096}), ToolCall("hungry", {"mb": 16})])
        assert [r.content for r in (res[0], res[2])] == ["8", "16"] and not res[0].error and not res[2].error
        assert res[1].error and not res[1].timeout
        assert "hungry ran out of memory (over rollout.multi_turn.tool_max_memory_mb=256)" in res[1].content
        assert len(pool.started_pids) == 1  # the same worker answered after the failed allocation
    finally:
        pool.close()
