"""The SGLang rollout engine: the RolloutEngine interface over an in-process `sglang.Engine`.

Owns starting and stopping SGLang (its scheduler runs in its own processes), sending token ids rather than
text (transformers and SGLang may tokenize the same text differently), and the weight update path users
run at scale: `init_weights_update_group` once (NCCL on GPU, gloo on CPU), then for every sync
`begin_weight_update` -> one `update_weights_from_distributed(load_format="flattened_bucket")` per bucket,
its flat buffer broadcast from the trainer -> `end_weight_update` -> `flush_cache`. The buckets are
grpo_mega.engines.weight_sync's (same byte layout as SGLang's FlattenedTensorBucket), so the trainer's
TP/PP and the engine's TP are independent. Every call into SGLang has a timeout: an engine that dies or
stops answering raises EngineError instead of hanging (a SIGALRM deadline on the main thread, where SGLang's
client runs its event loop).

On a machine without CUDA (CI): SGLANG_USE_CPU_ENGINE=1, the stand-in `sgl_kernel` from tests/fixtures
first on PYTHONPATH, torch_native attention, no CUDA graphs, a bounded KV cache.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import sys
import threading
from typing import Iterable, Optional

import torch

from grpo_mega.processes import free_port
from grpo_mega.engines import validate
from grpo_mega.engines.interface import ENGINES, Bucket, Generation, RolloutEngine, sample_seed, tensor_checksum


class EngineError(RuntimeError):
    """SGLang failed, died or did not answer in time."""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


@ENGINES.register("sglang")
class SGLangEngine(RolloutEngine):
    runs_own_event_loop = True
    """generate runs SGLang's asyncio loop (run_until_complete), which cannot run inside another running loop:
    the multi-turn agent loop calls it from a worker thread (grpo_mega.rollout.agent_loop; no SIGALRM deadline
    there, signals reach the main thread only)."""

    def __init__(self, model_path: str, tp: int = 1, dtype: str = "float32", mem_tokens: Optional[int] = None,
                 timeout_s: float = 300.0, log_level: str = "error", **engine_kwargs):
        cuda = torch.cuda.is_available()
        if not cuda:
            os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
            sys.modules.setdefault("flash_mla", None)  # its import raises OSError without libcuda
        try:
            import sglang
        except ImportError as e:
            raise EngineError(f"rollout.engine=sglang needs SGLang: pip install -e '.[sglang]' ({e})") from None
        self.timeout_s = timeout_s
        kwargs = dict(model_path=model_path, tp_size=tp, dtype=dtype, skip_tokenizer_init=True, log_level=log_level)
        if mem_tokens is not None or not cuda:  # on GPUs SGLang sizes its KV cache from mem_fraction_static
            kwargs["max_total_tokens"] = mem_tokens or 4096
        if not cuda:
            kwargs.update(device="cpu", attention_backend="torch_native", disable_cuda_graph=True)
        kwargs.update(engine_kwargs)
        try:
            self.engine = sglang.Engine(**kwargs)
        except Exception as e:
            raise EngineError(f"SGLang failed to start for {model_path}: {e}") from e
        self.weight_version = 0
        self.output_spec = validate.OutputSpec()  # the vocabulary is checked by the run's Engines (placement.py)
        self._dead: Optional[str] = None
        self._install_death_handler()
        self._group = None
        self._group_name = "grpo_mega_weights"
        self.dtype = getattr(torch, dtype)

    @classmethod
    def from_model_config(cls, cfg, workdir, **kwargs) -> "SGLangEngine":
        """An engine with this architecture, started from a freshly initialised HF checkpoint written to
        `workdir` (the trainer's weights arrive with the first sync)."""
        from transformers import AutoConfig, AutoModelForCausalLM

        from grpo_mega.models.bridge import FAMILIES

        hf = FAMILIES.get(cfg.family).hf_config(cfg, dtype="float32")
        config = AutoConfig.for_model(hf.pop("model_type"), **{k: v for k, v in hf.items() if k != "architectures"})
        config.architectures = hf["architectures"]
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(workdir, safe_serialization=True)
        return cls(str(workdir), dtype="float32", **kwargs)

    @classmethod
    def for_run(cls, spec) -> "SGLangEngine":
        """The run's engine (an EngineSpec): SGLang on the HF checkpoint, or on a fresh one of the model's shape."""
        if spec.hf_dir is None:
            return cls.from_model_config(spec.model, spec.workdir, timeout_s=spec.timeout_s)
        extra = {"mem_fraction_static": spec.mem_fraction} if spec.mem_fraction else {}
        return cls(spec.hf_dir, tp=spec.tp, dtype=spec.dtype, timeout_s=spec.timeout_s, **extra)

    # ---- calls with a deadline --------------------------------------------------------------------

    @contextlib.contextmanager
    def _deadline(self, what: str):
        """SIGALRM after timeout_s (SGLang's client runs its asyncio loop on this, the main, thread)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def expire(signum, frame):
            raise EngineError(f"SGLang did not answer {what} within {self.timeout_s:.0f} s (engine dead or stuck?)")

        old = signal.signal(signal.SIGALRM, expire)
        signal.setitimer(signal.ITIMER_REAL, self.timeout_s)
        try:
            yield
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)

    def _install_death_handler(self) -> None:
        """SGLang's watchdog signals its host with SIGQUIT when a scheduler process dies, and SGLang's
        handlers then kill the whole process tree, host included: the trainer would vanish without a word.
        Ours ends the engine's own processes, stops the pending call and lets it raise EngineError."""
        from sglang.srt.managers.tokenizer_manager import SignalHandler
        from sglang.srt.utils import kill_process_tree

        engine = self

        def on_death(signum=None, frame=None):
            engine._dead = "an SGLang scheduler process died (its watchdog sent SIGQUIT)"
            tm = getattr(engine.engine, "tokenizer_manager", None)
            watchdog = getattr(tm, "_subprocess_watchdog", None)
            if watchdog is not None:
                watchdog.stop()
            kill_process_tree(os.getpid(), include_parent=False)
            loop = getattr(tm, "event_loop", None)
            if loop is not None and loop.is_running():
                loop.stop()  # run_until_complete then raises, and _call turns that into EngineError

        class Handler(SignalHandler):
            def running_phase_sigquit_handler(self, signum=None, frame=None):
                on_death(signum, frame)

        self.engine.tokenizer_manager.signal_handler_class = Handler
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGQUIT, on_death)

    def _call(self, what: str, fn, *args, **kwargs):
        if self.engine is None:
            raise EngineError(f"SGLang engine is shut down ({what})")
        if self._dead:
            raise EngineError(f"{self._dead}; cannot {what}")
        with self._deadline(what):
            try:
                return fn(*args, **kwargs)
            except EngineError:
                raise
            except Exception as e:
                if self._dead:
                    raise EngineError(f"{self._dead}, during {what}") from e
                raise EngineError(f"SGLang failed in {what}: {e}") from e

    @staticmethod
    def _in_thread(fn, *args, **kwargs) -> tuple[threading.Thread, dict]:
        box: dict = {}

        def run():
            try:
                box["result"] = fn(*args, **kwargs)
            except BaseException as e:  # noqa: BLE001 - handed back to the caller
                box["error"] = e

        t = threading.Thread(target=run, daemon=True)
        t.start()
        return t, box

    def _join(self, what: str, t: threading.Thread, box: dict):
        t.join(self.timeout_s)
        if t.is_alive():
            raise EngineError(f"{what} did not finish within {self.timeout_s:.0f} s")
        if "error" in box:
            raise EngineError(f"{what} failed: {box['error']}") from box["error"]
        return box.get("result")

    # ---- generation -------------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], n: int, temperature: float, top_p: float, max_new_tokens: int,
                 stop_token_ids: Iterable[int], seed: int, prompt_offset: int = 0,
                 row_seeds: Optional[list[int]] = None) -> Generation:
        """As RolloutEngine.generate; with `row_seeds` (n=1, one per prompt; what grpo_mega.rollout.multi_turn
        passes) prompt i's sampling_seed is row_seeds[i] mod 2**31."""
        if row_seeds is not None and (n != 1 or len(row_seeds) != len(prompts)):
            raise ValueError(f"row_seeds needs n=1 and one seed per prompt; got n={n}, {len(row_seeds)} seeds for "
                             f"{len(prompts)} prompts")
        input_ids, params = [], []
        for p, prompt in enumerate(prompts):
            for j in range(n):
                row_seed = row_seeds[p] if row_seeds is not None else sample_seed(seed, prompt_offset + p, j)
                input_ids.append(list(prompt))
                params.append(dict(temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens,
                                   stop_token_ids=list(stop_token_ids), sampling_seed=row_seed % (2**31),
                                   skip_special_tokens=False, no_stop_trim=True))
        out = self._call("generate", self.engine.generate, input_ids=input_ids, sampling_params=params,
                         return_logprob=True)
        tokens, logps, finish = [], [], []
        for k, o in enumerate(out):
            try:  # the same checks as a server's answer (grpo_mega.engines.validate), before anything is kept
                ids, lps, reason = validate.sglang_sample(o, self.output_spec)
            except validate.BadOutput as e:
                raise EngineError(f"SGLang's Engine.generate returned a bad output {k}: {e}") from None
            tokens.append(ids)
            logps.append(lps)
            finish.append(reason)
        return Generation(token_ids=tokens, logprobs=logps, finish_reasons=finish, weight_version=self.weight_version)

    # ---- weights ---------------------------------------------------------------------------------

    def _ensure_group(self) -> None:
        """Join a group with the engine (trainer at rank 0, engine TP ranks after it) for the broadcasts."""
        if self._group is not None:
            return
        from sglang.srt.utils import init_custom_process_group

        port = free_port()
        tp = self.engine.server_args.tp_size
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        t, box = self._in_thread(
            init_custom_process_group, backend=backend, init_method=f"tcp://127.0.0.1:{port}", world_size=tp + 1,
            rank=0, group_name=self._group_name, timeout=datetime.timedelta(seconds=self.timeout_s))
        ok, msg = self._call("init_weights_update_group", self.engine.init_weights_update_group,
                             master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=tp + 1,
                             group_name=self._group_name, backend=backend)
        group = self._join("joining SGLang's weight-update group", t, box)
        if not ok:
            raise EngineError(f"SGLang refused the weight-update group: {msg}")
        self._group = group

    def update_weights(self, version: int, buckets: Iterable[Bucket]) -> None:
        import torch.distributed as dist

        self._ensure_group()
        self._call("begin_weight_update", self.engine.begin_weight_update, selector="all")
        for bucket in buckets:
            names = [m.name for m in bucket.metas]
            t, box = self._in_thread(dist.broadcast, bucket.flat, src=0, group=self._group)
            ok, msg = self._call("update_weights_from_distributed", self.engine.update_weights_from_distributed,
                                 names=names, dtypes=[_dtype_name(m.dtype) for m in bucket.metas],
                                 shapes=[list(m.shape) for m in bucket.metas], group_name=self._group_name,
                                 flush_cache=False, load_format="flattened_bucket")
            self._join("broadcasting a weight bucket", t, box)
            if not ok:
                raise EngineError(f"SGLang rejected weights {names[:3]}...: {msg}")
        self._call("end_weight_update", self.engine.end_weight_update)
        self._call("flush_cache", self.engine.flush_cache)
        self.weight_version = version

    def weight_checksums(self, shapes: Optional[dict[str, tuple]] = None) -> dict[str, str]:
        """Checksums of the live parameters named in `shapes`, read back with `get_weights_by_name`
        (SGLang implements it for Llama-family models, not Qwen2). SGLang pads the vocabulary of its
        embedding and LM head; rows past the HF shape are cut off."""
        if shapes is None:
            raise EngineError("SGLangEngine.weight_checksums needs the names and shapes (SGLang cannot list them)")
        out = {}
        for name, shape in shapes.items():
            w = self._call(f"get_weights_by_name({name})", self.engine.get_weights_by_name, name,
                           truncate_size=int(shape[0]) if shape else 1)
            if w is None:
                raise EngineError(f"SGLang cannot read back {name} (get_weights_by_name is not implemented for this model)")
            out[name] = tensor_checksum(torch.as_tensor(w, dtype=self.dtype).reshape(shape))
        return out

    def health(self) -> dict:
        try:
            self._call("health", self.engine.get_server_info)
            return {"ok": True, "weight_version": self.weight_version, "engine": "sglang"}
        except EngineError as e:
            return {"ok": False, "error": str(e), "weight_version": self.weight_version, "engine": "sglang"}

    def shutdown(self) -> None:
        engine, self.engine = getattr(self, "engine", None), None
        if engine is not None:
            try:
                with self._deadline("shutdown"):
                    engine.shutdown()
            finally:
                if threading.current_thread() is threading.main_thread():
                    signal.signal(signal.SIGQUIT, signal.SIG_DFL)
