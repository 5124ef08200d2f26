"""A tool worker process: `python -m grpo_mega.toolcalls.worker FD`, started by grpo_mega.toolcalls.pool with a
scrubbed environment, its own temporary directory as working directory and HOME, and FD one end of a socket
pair. It imports only this module, grpo_mega.toolcalls and the run's tool modules (no torch, Hydra or the
trainer's main module), caps its own memory, builds each tool once and holds the per-trajectory instances.

Requests over FD, one at a time (pickled by multiprocessing.connection):
  ("call", (trajectory, name), create_kwargs, args, execute_kwargs) -> ("ok" | "error", text, flags)
      the trajectory's instance of tool `name` (made on its first call: a shallow copy of the tool, then
      `create(**create_kwargs)`) runs `call(args, **execute_kwargs)`; flags: {"nonstring": a result that was not
      a str (sent as str(result)), "truncated": a result cut to the pool's max_chars};
  ("release", (trajectory, name)) -> ("released", reward or None, error text or None)
      `reward()` then `release()` of that instance, which is dropped.
The first message is ("init", tool names, max_memory_mb, max_chars, parent pid); the answer ("ready", names,
{"import_s", "rss_mib"}) or ("fatal", message)."""

from __future__ import annotations

import copy
import os
import signal
import sys
import time


def _rss_mib() -> float:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return 0.0


def clip(text: str, max_chars: int) -> tuple[str, bool]:
    """At most `max_chars` characters ('...[truncated N chars]' marks a cut), as text that encodes to UTF-8
    (lone surrogates replaced)."""
    cut = len(text) > max_chars
    if cut:
        text = text[:max_chars] + f"...[truncated {len(text) - max_chars} chars]"
    return text.encode("utf-8", "replace").decode("utf-8"), cut


def _as_text(out, max_chars: int) -> tuple[str, dict]:
    nonstring = not isinstance(out, str)
    if nonstring:
        out = out.decode("utf-8", "replace") if isinstance(out, bytes) else str(out)
    text, cut = clip(out, max_chars)
    return text, {"nonstring": nonstring, "truncated": cut}


def serve(conn) -> None:
    """Answer requests on `conn` until it closes."""
    t0 = time.perf_counter()
    _, names, max_memory_mb, max_chars, parent = conn.recv()
    from grpo_mega.workers import die_with_parent, limit_memory

    die_with_parent()
    if os.getppid() != parent:  # the parent died before the death signal was armed
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    over = f" (over rollout.multi_turn.tool_max_memory_mb={max_memory_mb})" if max_memory_mb else ""
    try:
        limit_memory(max_memory_mb)
        from grpo_mega.toolcalls import ToolError, build_tools

        tools = build_tools(names)
    except BaseException as e:  # noqa: BLE001 - reported by the parent
        conn.send(("fatal", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", sorted(tools), {"import_s": time.perf_counter() - t0, "rss_mib": _rss_mib()}))
    instances: dict = {}
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):
            return
        if request[0] == "release":
            key = request[1]
            inst, reward, error = instances.pop(key, None), None, None
            if inst is not None:
                try:
                    reward = inst.reward()
                    reward = None if reward is None else float(reward)
                except Exception as e:  # noqa: BLE001 - user code
                    reward, error = None, f"{key[1]}.reward raised {type(e).__name__}: {str(e)[:200]}"
                try:
                    inst.release()
                except Exception as e:  # noqa: BLE001 - user code
                    error = error or f"{key[1]}.release raised {type(e).__name__}: {str(e)[:200]}"
            reply = ("released", reward, error)
        else:
            _, key, create_kwargs, args, execute_kwargs = request
            name = key[1]
            try:
                inst = instances.get(key)
                if inst is None:
                    inst = copy.copy(tools[name])
                    try:
                        inst.create(**create_kwargs)
                    except ToolError:
                        raise
                    except Exception as e:  # noqa: BLE001 - user code
                        raise ToolError(f"{name} could not be created for this sample: {type(e).__name__}: {e}") from e
                    instances[key] = inst
                text, flags = _as_text(inst.call(args, **execute_kwargs), max_chars)
                reply = ("ok", text, flags)
            except ToolError as e:
                reply = ("error", clip(f"Error: {e}", max_chars)[0], {})
            except MemoryError as e:  # over the cap: this call fails, the worker (its memory freed) goes on
                reply = ("error", f"Error: {name} ran out of memory{over}: {e}", {})
            except BaseException as e:  # noqa: BLE001 - user code: its message is the tool's turn
                if isinstance(e, (KeyboardInterrupt, SystemExit)):
                    raise
                try:
                    message = f"Error: {name} raised {type(e).__name__}: {e}"
                except Exception:  # noqa: BLE001 - an exception whose str() raises
                    message = f"Error: {name} raised {type(e).__name__}"
                reply = ("error", clip(message, max_chars)[0], {})
        try:
            conn.send(reply)
        except (BrokenPipeError, OSError):
            return


def main() -> None:
    from multiprocessing.connection import Connection

    serve(Connection(int(sys.argv[1])))


if __name__ == "__main__":
    main()
