"""The embedded rollout engine: the RolloutEngine interface over an HF transformers model, in-process.

For machines without SGLang (CI, laptops, the demo). Batched sampling with a KV cache, left-padded prompts,
one seeded generator per sample (so a sample does not depend on what else is in the batch) drawing that
sample's uniforms, inverse-CDF sampling of the whole batch at once, logprobs of softmax(logits / temperature)
at the sampled token. bench/decode.py holds it against transformers' `generate`. For routing replay
(algo.routing_replay=rollout or measure) it records the top-k experts transformers' MoE routers pick for every
token it feeds the model (forward hooks; Generation.routed_experts).

A PrefixCache (`enable_prefix_cache`) holds, for the stand-in server's decode loop (grpo_mega.engines.continuous),
the keys and values of rows cut by their budget, for the request that continues them (SGLang's radix cache);
loading weights empties it, like SGLang's /flush_cache after an update.
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from typing import Callable, Iterable, Optional

import torch

from grpo_mega.conf.model import ModelConfig
from grpo_mega.engines.interface import ENGINES, Bucket, Generation, RolloutEngine, sample_seed, tensor_checksum
from grpo_mega.parallel.cpu_compat import without_device_mode


def _plain_torch(method):
    """`method` outside the CPU shim's device mode (cpu_compat.without_device_mode): the engine's own code and its
    transformers model name no CUDA device, and a decode step's torch calls would each pay the mode's dispatch."""
    @functools.wraps(method)
    def call(*args, **kwargs):
        with without_device_mode():
            return method(*args, **kwargs)

    return call


def _top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero the tail of each row beyond cumulative probability top_p (the nucleus keeps >= 1 token)."""
    if top_p >= 1.0:
        return probs
    sorted_p, idx = probs.sort(dim=-1, descending=True)
    keep = sorted_p.cumsum(-1) - sorted_p < top_p
    keep[..., 0] = True
    filtered = torch.zeros_like(probs).scatter(-1, idx, sorted_p * keep)
    return filtered / filtered.sum(-1, keepdim=True)


def sample_rows(logp: torch.Tensor, top_p: float | list[float], uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row of `logp` [b, V] (log-probabilities at the row's temperature) by inverse CDF: each row's
    nucleus (`top_p`, one for all rows or one per row; 1 leaves a row as it is), then the first token whose
    cumulative probability exceeds uniforms[r] x the row's total, so never one of probability 0. The embedded
    engine and the stand-in's continuous batcher both sample here: a row's tokens depend on its uniforms alone."""
    probs = logp.exp()
    if isinstance(top_p, (int, float)):
        probs = _top_p_filter(probs, top_p)
    else:
        for r, p in enumerate(top_p):
            if p < 1:
                probs[r] = _top_p_filter(probs[r:r + 1], p)[0]
    cdf = probs.double().cumsum(-1)
    tok = torch.searchsorted(cdf, (uniforms * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
    return tok.clamp(max=cdf.shape[1] - 1)


def checkpoint_views(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors under their checkpoint names (what the weight sync sends): the parameters, except
    that transformers 5 holds a Qwen3-MoE layer's experts fused (`mlp.experts.gate_up_proj` [E, 2I, h],
    `mlp.experts.down_proj` [E, h, I]) while its checkpoints, and the bridge, name each expert's
    `mlp.experts.{j}.{gate,up,down}_proj.weight`: those are views into the fused parameters."""
    out = {}
    for name, p in model.named_parameters():
        prefix, _, leaf = name.rpartition(".")
        if prefix.endswith("mlp.experts") and leaf in ("gate_up_proj", "down_proj") and p.dim() == 3:
            for j in range(p.shape[0]):
                if leaf == "down_proj":
                    out[f"{prefix}.{j}.down_proj.weight"] = p[j]
                else:
                    gate, up = p[j].chunk(2, dim=0)
                    out[f"{prefix}.{j}.gate_proj.weight"], out[f"{prefix}.{j}.up_proj.weight"] = gate, up
        else:
            out[name] = p
    return out


def _moe_routers(model: torch.nn.Module) -> list:
    """The model's MoE routers in layer order (transformers' Qwen3MoeTopKRouter: `mlp.gate` of a sparse layer,
    returning (router_logits, top-k weights, top-k indices))."""
    return [m.mlp.gate for m in model.model.layers if hasattr(m.mlp, "gate") and hasattr(m.mlp, "experts")] \
        if hasattr(model, "model") and hasattr(model.model, "layers") else []


class PrefixCache:
    """Per sequence fed to the model, the key/value tensors of its tokens ([heads, tokens, head_dim] per layer),
    kept for a request that continues it; each entry is taken once. At most `max_bytes` held, the oldest dropped.
    Thread-safe (the stand-in's decode loop fills it while a request thread may flush it)."""

    def __init__(self, max_bytes: int = 256 << 20):
        self.entries: OrderedDict[tuple, list] = OrderedDict()
        self.max_bytes, self.bytes = max_bytes, 0
        self.hits = self.misses = 0
        self.lock = threading.Lock()

    @staticmethod
    def _size(kv: list) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)

    def take(self, ids: list[int]) -> Optional[list]:
        with self.lock:
            kv = self.entries.pop(tuple(ids), None)
            if kv is None:
                self.misses += 1
                return None
            self.hits += 1
            self.bytes -= self._size(kv)
            return kv

    def put(self, ids: list[int], kv: list) -> None:
        key = tuple(ids)
        with self.lock:
            if key in self.entries:
                self.bytes -= self._size(self.entries.pop(key))
            self.entries[key] = kv
            self.bytes += self._size(kv)
            while self.bytes > self.max_bytes and self.entries:
                self.bytes -= self._size(self.entries.popitem(last=False)[1])

    def clear(self) -> None:
        with self.lock:
            self.entries.clear()
            self.bytes = 0


DECODE_MODES = ("auto", "dynamic", "static", "compiled")
"""How the embedded engine decodes (rollout.embedded_decode): 'dynamic': transformers' DynamicCache, the key/value
tensors grown by concatenation every token; 'static': a StaticCache preallocated per batch at prompt width +
max_new_tokens, filled in place, each step's inputs of one shape; 'compiled' (CUDA): static, and the per-token
forward under torch.compile(mode="reduce-overhead"), i.e. replayed as a CUDA graph; 'auto': compiled on CUDA,
dynamic on the CPU (bench_results/decode.json: static is no faster there)."""


@ENGINES.register("embedded")
class EmbeddedEngine(RolloutEngine):
    loads_tensors = True  # load_bucket copies tensor by tensor: an unflattened bucket is loaded as is

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype = torch.float32, device: str = "cpu",
                 record_routing: bool = False, decode: str = "auto"):
        if decode not in DECODE_MODES:
            raise ValueError(f"rollout.embedded_decode={decode!r}: use one of {', '.join(DECODE_MODES)}")
        if decode == "compiled" and not str(device).startswith("cuda"):
            raise ValueError(f"rollout.embedded_decode=compiled needs a CUDA device (the engine runs on {device}); "
                             "use auto, static or dynamic")
        self.decode = decode
        self._compiled_step = None
        self.compile_error: Optional[str] = None
        """Why the compiled step fell back to the eager one (None: it did not)."""
        self.model = model.to(device=device, dtype=dtype).eval()
        self.model.requires_grad_(False)
        self.device, self.dtype = device, dtype
        self.params = checkpoint_views(self.model)
        self.weight_version = 0
        self.routers = _moe_routers(self.model)
        if record_routing and not self.routers:
            raise ValueError(f"routing replay: the engine's model ({type(self.model).__name__}) has no MoE router")
        self.record_routing = record_routing
        self.prefix_cache: Optional[PrefixCache] = None
        self.aborting = threading.Event()
        """Set (by another thread: the stand-in's /pause_generation, mode abort): generate() ends after the step it is
        in, each row not yet done with the tokens it has and finish "abort"."""
        self._routes: list = []  # per forward call: [M] of [b, s, k]
        for r in self.routers:
            r.register_forward_hook(self._router_hook)

    @classmethod
    def from_model_config(cls, cfg: ModelConfig, dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0,
                          decode: str = "auto"):
        """An engine with this architecture (weights arrive by update_weights)."""
        from transformers import AutoConfig, AutoModelForCausalLM

        from grpo_mega.models.bridge import FAMILIES

        hf = FAMILIES.get(cfg.family).hf_config(cfg, dtype="float32")
        config = AutoConfig.for_model(hf.pop("model_type"), **{k: v for k, v in hf.items() if k != "architectures"})
        torch.manual_seed(seed)
        with torch.device(device):  # built where it runs: a GPU initialises a 1.5B model in a second, a CPU in ~20
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        return cls(model, dtype, device, decode=decode)

    @classmethod
    def from_hf_dir(cls, hf_dir: str, dtype: torch.dtype = torch.float32, device: str = "cpu", decode: str = "auto"):
        from transformers import AutoModelForCausalLM

        return cls(AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype), dtype, device, decode=decode)

    @classmethod
    def for_run(cls, spec) -> "EmbeddedEngine":
        """The run's engine (an EngineSpec): on the rank's own device, from the HF checkpoint or the model config."""
        if spec.hf_dir is not None:
            engine = cls.from_hf_dir(spec.hf_dir, device=spec.device, decode=spec.decode)
        else:
            engine = cls.from_model_config(spec.model, seed=spec.seed, device=spec.device, decode=spec.decode)
        if spec.record_routing:
            engine.enable_routing_record()
        return engine

    def enable_prefix_cache(self, max_bytes: int = 256 << 20) -> None:
        """Hold keys and values for the continuous batcher (grpo_mega.engines.continuous), emptied by a weight load."""
        self.prefix_cache = PrefixCache(max_bytes)

    # ---- routing (algo.routing_replay=rollout or measure) --------------------------------------------------------

    def enable_routing_record(self) -> None:
        if not self.routers:
            raise ValueError(f"routing replay: the engine's model ({type(self.model).__name__}) has no MoE router")
        self.record_routing = True

    def _router_hook(self, router, inputs, output):
        """Records the layer's top-k ([tokens, k]) as the router chose it (after any hook registered before this
        one, with prepend=True, changed the choice)."""
        if self.record_routing:
            self._routes.append(output[2].detach().to(torch.int16))  # on the model's device until generate() ends

    # ---- generation -------------------------------------------------------------------------------

    @torch.no_grad()
    @_plain_torch
    def generate(self, prompts: list[list[int]], n: int, temperature: float, top_p: float, max_new_tokens: int,
                 stop_token_ids: Iterable[int], seed: int, prompt_offset: int = 0,
                 row_seeds: Optional[list[int]] = None, row_max_new_tokens: Optional[list[int]] = None,
                 on_row_done: Optional[Callable[[int, list[int], list[float], str], None]] = None) -> Generation:
        """As RolloutEngine.generate; with `row_seeds` (n=1, one per prompt) sample i is drawn with generator
        seed row_seeds[i] instead (the server's path: SGLang's per-request sampling_seed). `row_max_new_tokens`:
        a budget per row (at most max_new_tokens; a row that reaches its own ends with "length"); `on_row_done(row,
        ids, logprobs, finish)` is called, from this thread, as soon as a row ends, while the others decode on
        (how a multi-turn driver starts a trajectory's tool calls before the batch is done). A row's tokens do
        not depend on either, nor on the other rows."""
        from transformers import DynamicCache, StaticCache

        if n < 1 or max_new_tokens < 1:
            raise ValueError(f"n={n} and max_new_tokens={max_new_tokens} must be >= 1")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("an empty prompt cannot be continued: every prompt needs at least one token")
        if temperature < 0 or not 0 < top_p <= 1:
            raise ValueError(f"temperature={temperature} must be >= 0 and top_p={top_p} in (0, 1]")
        rows = [(p, j) for p in range(len(prompts)) for j in range(n)]
        b = len(rows)
        width = max(len(p) for p in prompts)
        ids = torch.zeros(b, width, dtype=torch.long)
        mask = torch.zeros(b, width, dtype=torch.long)
        for r, (p, _) in enumerate(rows):
            ids[r, width - len(prompts[p]):] = torch.tensor(prompts[p])
            mask[r, width - len(prompts[p]):] = 1
        if row_seeds is not None and (n != 1 or len(row_seeds) != len(prompts)):
            raise ValueError(f"row_seeds needs n=1 and one seed per prompt; got n={n}, {len(row_seeds)} seeds for "
                             f"{len(prompts)} prompts")
        # Each row draws its step's uniform from its own seeded generator, all of them up front: a sample does not
        # depend on what else is in the batch, and every step then samples all rows at once (inverse CDF), on the
        # model's device, with no per-row work beyond reading the chosen ids back.
        gens = [torch.Generator().manual_seed(row_seeds[p] if row_seeds is not None else
                                              sample_seed(seed, prompt_offset + p, j)) for p, j in rows]
        uniforms = torch.stack([torch.rand(max_new_tokens, generator=g, dtype=torch.float64) for g in gens])
        uniforms = uniforms.to(self.device)
        stop = set(int(t) for t in stop_token_ids)
        budgets = list(row_max_new_tokens) if row_max_new_tokens is not None else [max_new_tokens] * b
        if len(budgets) != b or not all(1 <= x <= max_new_tokens for x in budgets):
            raise ValueError(f"row_max_new_tokens needs one budget in [1, max_new_tokens={max_new_tokens}] per row "
                             f"({b} rows); got {budgets}")
        mode = self.decode_mode()
        self._routes = []
        if mode == "dynamic":
            cache = DynamicCache()
        else:  # one preallocated cache for the batch; the mask covers all of it, its unfilled slots 0
            cache = StaticCache(config=self.model.config, max_cache_len=width + max_new_tokens)
            full_mask = torch.zeros(b, width + max_new_tokens, dtype=torch.long, device=self.device)
            full_mask[:, :width] = mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                         position_ids=positions.to(self.device), past_key_values=cache, use_cache=True)
        next_logits = out.logits[:, -1].float()
        del out
        steps_routes = [self._take_routes(b)]  # [b, width, M, k], then [b, 1, M, k] per decode step
        next_pos = positions[:, -1] + 1
        step_fn = self._decode_step(mode)
        tokens: list[list[int]] = [[] for _ in range(b)]
        logps: list[list[float]] = [[] for _ in range(b)]
        finish = ["length"] * b
        active = [True] * b
        for step in range(max_new_tokens):
            logits = next_logits
            scaled = logits / temperature if temperature > 0 else logits
            logp_all = torch.log_softmax(scaled, dim=-1)
            if temperature == 0:
                tok = scaled.argmax(-1)
            else:
                tok = sample_rows(logp_all, top_p, uniforms[:, step])
            lp = logp_all.gather(1, tok[:, None])[:, 0]
            tok_l, lp_l = tok.tolist(), lp.tolist()
            for r in range(b):
                if not active[r]:
                    continue
                tokens[r].append(tok_l[r])
                logps[r].append(lp_l[r])
                if tok_l[r] in stop:
                    finish[r] = "stop"
                    active[r] = False
                elif len(tokens[r]) >= budgets[r]:
                    active[r] = False  # finish stays "length"
                if not active[r] and on_row_done is not None:
                    on_row_done(r, tokens[r], logps[r], finish[r])
            if any(active) and self.aborting.is_set():
                for r in range(b):
                    if active[r]:
                        finish[r], active[r] = "abort", False
                        if on_row_done is not None:
                            on_row_done(r, tokens[r], logps[r], finish[r])
            if not any(active) or step == max_new_tokens - 1:
                break
            if mode == "dynamic":
                mask = torch.cat([mask, torch.ones(b, 1, dtype=torch.long)], dim=1)
                step_mask = mask.to(self.device)
            else:
                full_mask[:, width + step] = 1
                step_mask = full_mask
            next_logits = step_fn(tok[:, None].to(self.device), step_mask, next_pos[:, None].to(self.device), cache)
            steps_routes.append(self._take_routes(b))
            next_pos = next_pos + 1
        routed = None
        if self.record_routing:  # the prompt's own positions (left padding dropped), then the fed response tokens
            steps_routes = [r.cpu() for r in steps_routes]  # one copy per forward, after the last one
            decode = torch.cat(steps_routes[1:], dim=1) if len(steps_routes) > 1 else None
            routed = []
            for r, (p, _) in enumerate(rows):
                parts = [steps_routes[0][r, width - len(prompts[p]):]]
                if decode is not None:
                    parts.append(decode[r, : len(tokens[r]) - 1])
                routed.append(torch.cat(parts).contiguous())
        return Generation(token_ids=tokens, logprobs=logps, finish_reasons=finish, weight_version=self.weight_version,
                          routed_experts=routed)

    def decode_mode(self) -> str:
        """The decode this engine runs (DECODE_MODES), 'auto' resolved for its device. Recording routes or adding
        router noise runs hooks on every forward: those stay eager."""
        mode = self.decode
        if mode == "auto":
            mode = "compiled" if str(self.device).startswith("cuda") else "dynamic"
        if mode == "compiled" and (self.record_routing or self.router_noise or self.compile_error):
            mode = "static"
        return mode

    def _eager_step(self, input_ids, attention_mask, position_ids, cache) -> torch.Tensor:
        """One decode forward: the last position's logits, fp32 (a copy: a CUDA graph's output is overwritten by its
        next replay)."""
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=cache, use_cache=True)
        return out.logits[:, -1].float()

    def _decode_step(self, mode: str):
        if mode != "compiled":
            return self._eager_step
        if self._compiled_step is None:
            self._compiled_step = torch.compile(self._eager_step, mode="reduce-overhead", dynamic=False)
        compiled = self._compiled_step

        def step(*args):
            if self.compile_error is None:
                try:
                    return compiled(*args).clone()
                except Exception as e:  # noqa: BLE001  a compiler failure costs speed, not the run
                    import warnings

                    self.compile_error = f"{type(e).__name__}: {e}"[:500]
                    warnings.warn(f"embedded engine: the compiled decode step failed ({self.compile_error}); "
                                  "decoding eagerly with the static cache from now on")
            return self._eager_step(*args)
        return step

    def _take_routes(self, b: int) -> Optional[torch.Tensor]:
        """The forward call's recorded top-k as [b, s, M, k] (None when not recording)."""
        if not self.record_routing:
            return None
        got, self._routes = self._routes, []
        if len(got) != len(self.routers):
            raise RuntimeError(f"routing record: {len(got)} router calls in one forward, {len(self.routers)} routers")
        return torch.stack([g.view(b, -1, g.shape[-1]) for g in got], dim=2)

    # ---- weights ---------------------------------------------------------------------------------

    @torch.no_grad()
    @_plain_torch
    def load_bucket(self, bucket: Bucket) -> list[str]:
        """Copy one bucket's tensors into the model; returns their names. Held sequences are dropped (their keys
        and values are the old weights')."""
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
        names = []
        for name, t in bucket.tensors():
            param = self.params.get(name)
            if param is None:
                raise KeyError(f"weight sync sent {name!r}, which this engine's model does not have")
            if tuple(t.shape) != tuple(param.shape):
                raise ValueError(f"weight sync sent {name} with shape {tuple(t.shape)}; the engine has {tuple(param.shape)}")
            param.copy_(t.to(device=param.device, dtype=param.dtype))
            names.append(name)
        return names

    def update_weights(self, version: int, buckets: Iterable[Bucket]) -> None:
        seen: set[str] = set()
        for bucket in buckets:
            seen.update(self.load_bucket(bucket))
        missing = sorted(set(self.params) - seen)
        if missing:
            raise ValueError(f"weight sync version {version} did not update {len(missing)} tensors, e.g. {missing[:3]}")
        self.weight_version = version

    def weight_checksums(self, shapes: Optional[dict] = None) -> dict[str, str]:
        return {name: tensor_checksum(p) for name, p in self.params.items()}

    def health(self) -> dict:
        return {"ok": True, "weight_version": self.weight_version, "engine": "embedded", "device": self.device}

    def shutdown(self) -> None:
        self.model, self.params = None, {}

