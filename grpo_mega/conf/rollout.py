"""Generation (rollout.*, rollout.multi_turn.*): engine, placement, sampling, sync or async, tools."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional



@dataclass(kw_only=True)
class MultiTurnConfig:
    """rollout.multi_turn: multi-turn rollouts with tool calls (grpo_mega.rollout.multi_turn), token in and
    token out; tool results carry no loss."""

    enable: bool = False
    """Generate each sample turn by turn, running the tool calls the model writes (off: single-turn)."""
    max_turns: int = 4
    """The model's turns per sample; the last turn's tool calls are not run (counted: multi_turn/max_turns_reached).
    All turns and tool results fit in batch.max_response_length tokens (a trajectory cut by it ends 'length')."""
    tools: list[str] = field(default_factory=lambda: ["calculator"])
    """Tools by registered name (calculator) or dotted path to a grpo_mega.toolcalls.Tool (`pkg.mod:MyTool`)."""
    parser: str = "hermes"
    """How tool calls are found in a model turn: 'hermes' (alias 'qwen': <tool_call>{json}</tool_call>),
    'expression' or 'bare' (the toy tasks')."""
    agent_loop: str = ""
    """An `async def loop(traj)` by dotted path (`pkg.mod:fn`) that drives each trajectory (generate, call tools,
    reply as a user: docs/agents.md); '': the default loop (the model's turn, its tool calls, again)."""
    async_tools: bool = True
    """Tool calls run while the engine generates other samples' turns, and a sample goes on as soon as its own
    calls are answered; false: turns in lockstep (each batch waits for every sample's calls)."""
    tool_timeout_s: float = 10.0
    """A tool call still running after this is killed (its worker, by PID) and answers with an error."""
    tool_workers: int = 2
    """Worker processes per rollout engine running tool calls."""
    tool_max_memory_mb: Optional[int] = 2048
    """Cap on each tool worker's memory beyond its size at start (RLIMIT_AS; null or 0: none): a call over it
    answers with an error, the run goes on, and the node's OOM killer never has to pick a process."""
    tool_env: list[str] = field(default_factory=list)
    """Environment variables a tool worker gets beyond PATH, locale and time zone (all others, API keys
    included, are removed from its environment), e.g. [SEARCH_API_KEY]."""
    max_tool_response_chars: int = 4096
    """A tool result longer than this is cut to it and ends '...[truncated N chars]' (counted)."""
    max_tool_calls_per_turn: int = 8
    """Calls run per model turn; more are answered with one error turn (counted as errors)."""
    max_tool_call_chars: int = 8192
    """A call whose arguments (as JSON) are longer than this is answered with an error, not run."""
    call_stop: list[str] = field(default_factory=list)
    """Tokens (each one token of the tokenizer) that also end a model turn so its calls run, e.g. [</tool_call>];
    the chat template's own turn end follows them in the trajectory, as the template renders it."""

    def __post_init__(self):
        if self.max_tool_response_chars < 1:
            raise ValueError(f"rollout.multi_turn.max_tool_response_chars={self.max_tool_response_chars} must be >= 1")
        if self.max_turns < 1:
            raise ValueError(f"rollout.multi_turn.max_turns={self.max_turns} must be >= 1")
        if not self.tool_timeout_s > 0:
            raise ValueError(f"rollout.multi_turn.tool_timeout_s={self.tool_timeout_s} must be > 0")
        if self.tool_workers < 1:
            raise ValueError(f"rollout.multi_turn.tool_workers={self.tool_workers} must be >= 1")
        if self.tool_max_memory_mb is not None and self.tool_max_memory_mb < 0:
            raise ValueError(f"rollout.multi_turn.tool_max_memory_mb={self.tool_max_memory_mb} must be >= 0 "
                             "(0 or null: no limit)")
        if self.max_tool_calls_per_turn < 1:
            raise ValueError(f"rollout.multi_turn.max_tool_calls_per_turn={self.max_tool_calls_per_turn} must be >= 1")
        if self.max_tool_call_chars < 2:
            raise ValueError(f"rollout.multi_turn.max_tool_call_chars={self.max_tool_call_chars} must be >= 2")
        from grpo_mega.toolcalls.parsers import PARSERS

        try:
            PARSERS.get(self.parser)
        except ValueError as e:
            raise ValueError(f"rollout.multi_turn.parser: {e}") from None
        if not self.enable:
            return
        if not self.tools:
            raise ValueError("rollout.multi_turn.enable=true needs rollout.multi_turn.tools=[calculator,...]")
        from grpo_mega.toolcalls import build_tools

        tools = build_tools(self.tools)  # an unknown name or a path that does not import fails here
        if self.parser == "bare" and len(tools) != 1:
            raise ValueError(f"rollout.multi_turn.parser=bare calls the run's only tool; rollout.multi_turn.tools has "
                             f"{len(tools)}: {sorted(tools)}")
        if self.agent_loop:
            from grpo_mega.registry import import_async_function

            import_async_function(self.agent_loop, "rollout.multi_turn.agent_loop")


@dataclass(kw_only=True)
class RolloutConfig:
    """Sampling and weight sync."""

    engine: str = "embedded"
    """'embedded' (our engine, in the trainer's process) or 'sglang'; with placement=dedicated the servers'."""
    n: int = 4
    """Responses per prompt: the GRPO group (>= 2). A step trains batch.train_batch_size * n responses."""
    temperature: float = 1.0
    """Sampling temperature; logprobs are of softmax(logits / temperature) (docs/design.md)."""
    top_p: float = 1.0
    """Nucleus sampling."""
    embedded_decode: str = "auto"
    """The embedded engine's decode: 'dynamic' (a KV cache grown by concatenation), 'static' (one preallocated per
    batch, prompt width + max new tokens), 'compiled' (CUDA only: static, the per-token forward under
    torch.compile(mode="reduce-overhead"), replayed as a CUDA graph), 'auto' (compiled on CUDA, dynamic on the CPU,
    where static is no faster: bench_results/decode.json)."""
    engine_tp: int = 1
    """The SGLang engine's tensor-parallel size (its own; the trainer's parallel.tp need not match)."""
    gpu_memory_fraction: Optional[float] = None
    """SGLang's mem_fraction_static: the share of each GPU the colocated engine keeps (weights + KV cache);
    null: SGLang's default. grpo-mega-plan counts it against the trainer's memory."""
    num_engines: int = 1
    """Rollout engines, on global ranks 0, W/k, 2W/k, ...: each samples a contiguous share of the prompts
    (the samples do not depend on k). On a cluster, one per node (with engine_tp = GPUs per node)."""
    sync_bucket_mb: float = 64.0
    """Weight-sync bucket size."""
    audit_weights: bool = False
    """Checksum every synced tensor against the engine's copy."""
    placement: str = "colocated"
    """'colocated': engines inside trainer ranks, phases in turn. 'dedicated': the engines are the servers
    in `servers` (SGLang's HTTP API; `python -m grpo_mega.engines.standin_server` is the CPU stand-in), spoken to
    from global rank 0."""
    servers: list[str] = field(default_factory=list)
    """Dedicated placement: the servers' URLs, e.g. [http://10.0.0.5:30000, http://10.0.0.6:30000]."""
    server_timeout_s: float = 300.0
    """Dedicated placement: the longest a server may take to answer one request (a generate included)."""
    server_retries: int = 3
    """Dedicated placement: a generate or read that meets a transient failure (no connection, a reset, a timeout,
    HTTP 5xx) is tried again this many times; one still failing ends the run with exit status 75, which
    slurm/train.sbatch requeues (docs/slurm.md). Weight updates are never retried."""
    server_retry_backoff_s: float = 2.0
    """Seconds before the first retry, doubling before each next one (2, 4, 8 s)."""
    engine_timeout_s: float = 900.0
    """A colocated SGLang engine: the longest one call (a step's generation included) may take."""
    off_policy_steps: int = 0
    """0: each step generates, then trains. 1 (placement=dedicated): step k+1's samples are generated on the
    servers while step k trains, from the weights step k-1 trained from (one version behind; samples of step
    k >= 2 carry weight version k-2, version v being the weights after v steps); truncated importance
    correction (algo.engine_is_cap, default 2.0 here) covers the lag. With mode=async: any k >= 1, the staleness
    bound."""
    mode: str = "sync"
    """'sync': each step's batch is generated as one (in turn, or one step ahead with off_policy_steps=1). 'async'
    (placement=dedicated): fully asynchronous; the servers generate whole groups continuously from the prompt
    stream, the trainer takes the first train_batch_size completed groups whose oldest token's weight version is
    at least its own minus off_policy_steps (the staleness bound k >= 1; older groups are dropped and counted), and
    weights go to the servers after every update without waiting for generations in flight (docs/design.md,
    "Versions and off-policy"). It pays where generation is the longer part of a step (one step ahead's trainer
    still waits: `timing/generate_wait`); where training is, it is no faster than one step ahead and drops samples
    (docs/benchmarks.md, "Fully asynchronous")."""
    partial_rollouts: bool = True
    """mode=async: a response in flight when new weights arrive is interrupted and continued under them from its
    token prefix (each token records its version). false: each response is generated in one request and keeps the
    version it started on (the weight update waits for the server's requests in flight)."""
    segment_tokens: int = 0
    """mode=async with partial_rollouts: at most this many tokens per request, the response then sent again from its
    prefix (a weight update interrupts a request in flight whatever this is). 0: a response is one request until
    it ends or is interrupted; every further request costs the server a scheduling round and the trainer's core
    a round trip."""
    pause_mode: str = "abort"
    """mode=async with partial_rollouts: how a weight update pauses the requests in flight (SGLang's
    /pause_generation mode). 'abort': they end with their tokens so far and are sent again from that prefix (one
    more request per response in flight per update, and its prefix prefilled again). 'retract': they leave the
    server's running batch, open, and the server prefills them again under the new weights and samples on, each
    token's version in SGLang's weight_versions spans: no resend, but SGLang servers must run with
    --disable-radix-cache (checked at start-up; `python -m grpo_mega.engines.sglang_launch --training-flags` adds it),
    as its radix cache would hand them their prefix's old keys and values. 'in_place': they stay in the running
    batch and sample on under the new weights from the keys and values their prefix left under the old ones (no
    prefill again: NeMo-RL's and PipelineRL's in-flight update), each token's version in the same spans and its
    behaviour logprob the one its sampling step computed; SGLang servers run without a radix cache here too (no
    flush while requests run, so old prompts' keys and values would otherwise serve new requests)."""
    fresh_groups: bool = True
    """mode=async: start no new group while a batch of complete groups waits for the trainer, unless the trainer had
    to wait for its last batch. When generation outpaces training the samples are then about one version old
    instead of off_policy_steps (the servers idle meanwhile); when the trainer waits for samples the servers run
    ahead up to the staleness cap, as with false. false: the servers always run on to the cap, and when generation
    outpaces training nearly every sample is off_policy_steps versions old."""
    drop_stale: bool = True
    """mode=async: a group whose oldest token has fallen more than off_policy_steps versions behind the trainer is
    dropped, complete or in flight (counted in async/dropped_stale_samples): no token older than k trains. The groups
    that age are those waiting on a long response, so their generation is lost and training leans to the short ones.
    false: such a group is trained when it completes, its old tokens weighed by the rollout correction, and k bounds
    only how far ahead groups start (AReaL's max_head_offpolicyness); async/token_lag_over_k and
    async/sample_lag_over_k show how much trained past it."""
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    """Multi-turn rollouts with tool calls (off by default)."""
    dump_dir: str = ""
    """Write every trajectory (prompt and response ids, text, model mask, turns, tool calls, reward, advantage)
    as jsonl, one file per step (train_step_XXXXXXXX.jsonl) and per validation (val_step_XXXXXXXX.jsonl), by
    rank 0 (grpo_mega.rollout.dump); '': none."""
    replay_dir: str = ""
    """Train on the samples a run dumped (its dump_dir) instead of generating: step s takes train_step_s.jsonl's
    responses, behaviour logprobs and weight versions, with the prompts the task draws again in that run's order
    (grpo_mega.rollout.replay); the engines still take the weights and run validation. The rest of the config must
    be the dumping run's. For checking that a resumed run trains as an uninterrupted one on the same samples
    (experiments/kill_campaign.py --async); '': generate."""

    def __post_init__(self):
        if isinstance(self.multi_turn, dict):  # a checkpoint's saved config
            self.multi_turn = MultiTurnConfig(**self.multi_turn)
        if self.engine not in ("embedded", "sglang"):
            raise ValueError(f"rollout.engine={self.engine!r} must be 'embedded' or 'sglang'")
        if not isinstance(self.n, int) or self.n < 2:
            raise ValueError(f"rollout.n={self.n} must be >= 2 for GRPO: a group of one has no baseline")
        if self.placement not in ("colocated", "dedicated"):
            raise ValueError(f"rollout.placement={self.placement!r} must be 'colocated' or 'dedicated'")
        if self.embedded_decode not in ("auto", "dynamic", "static", "compiled"):
            raise ValueError(f"rollout.embedded_decode={self.embedded_decode!r} must be 'auto', 'dynamic', 'static' "
                             "or 'compiled'")
        if self.placement == "dedicated" and not self.servers:
            raise ValueError("rollout.placement=dedicated needs rollout.servers=[http://host:port,...]")
        if self.placement == "colocated" and self.servers:
            raise ValueError(f"rollout.servers={list(self.servers)} is for rollout.placement=dedicated; "
                             "set it, or drop the servers")
        if self.placement == "dedicated" and self.num_engines != 1:
            raise ValueError(f"rollout.num_engines={self.num_engines} must be 1 with placement=dedicated "
                             "(one client on rank 0 spreads the prompts over rollout.servers)")
        if self.mode not in ("sync", "async"):
            raise ValueError(f"rollout.mode={self.mode!r} must be 'sync' or 'async'")
        if self.mode == "async":
            if not isinstance(self.off_policy_steps, int) or self.off_policy_steps < 1:
                raise ValueError(f"rollout.mode=async needs rollout.off_policy_steps=k >= 1 (the staleness bound: a "
                                 f"sample's oldest token at most k versions behind the trainer); got {self.off_policy_steps}")
            if self.pause_mode not in ("abort", "retract", "in_place"):
                raise ValueError(f"rollout.pause_mode={self.pause_mode!r} must be 'abort', 'retract' or 'in_place' "
                                 "(SGLang's /pause_generation modes that keep each token's version known)")
            if not isinstance(self.segment_tokens, int) or self.segment_tokens < 0:
                raise ValueError(f"rollout.segment_tokens={self.segment_tokens} must be >= 0 (0: a response is one "
                                 "request until it ends or a weight update interrupts it)")
        elif not self.drop_stale:
            raise ValueError("rollout.drop_stale=false is for rollout.mode=async (sync mode's samples are exactly "
                             "off_policy_steps versions old, nothing is dropped); drop it or set rollout.mode=async")
        elif self.off_policy_steps not in (0, 1):
            raise ValueError(f"rollout.off_policy_steps={self.off_policy_steps} must be 0 or 1 with rollout.mode=sync "
                             "(rollout.mode=async takes any k >= 1 as its staleness bound)")
        if self.off_policy_steps and self.placement != "dedicated":
            raise ValueError(f"rollout.off_policy_steps={self.off_policy_steps} needs rollout.placement=dedicated "
                             f"(got {self.placement!r}): generation overlaps training only on servers of their own; "
                             "set rollout.placement=dedicated rollout.servers=[http://host:port]")
        if self.replay_dir and self.multi_turn.enable:
            raise ValueError("rollout.replay_dir replays single-turn samples: multi-turn dumps (tool turns, masks) "
                             "are not replayed; drop rollout.replay_dir or rollout.multi_turn.enable")
        if self.server_timeout_s <= 0:
            raise ValueError(f"rollout.server_timeout_s={self.server_timeout_s} must be > 0")
        if not isinstance(self.server_retries, int) or self.server_retries < 0:
            raise ValueError(f"rollout.server_retries={self.server_retries} must be >= 0")
        if self.server_retry_backoff_s < 0:
            raise ValueError(f"rollout.server_retry_backoff_s={self.server_retry_backoff_s} must be >= 0")
        if self.engine_timeout_s <= 0:
            raise ValueError(f"rollout.engine_timeout_s={self.engine_timeout_s} must be > 0")
        if self.num_engines < 1:
            raise ValueError(f"rollout.num_engines={self.num_engines} must be >= 1")
        if self.engine_tp < 1:
            raise ValueError(f"rollout.engine_tp={self.engine_tp} must be >= 1")
        if self.gpu_memory_fraction is not None and not 0 < self.gpu_memory_fraction < 1:
            raise ValueError(f"rollout.gpu_memory_fraction={self.gpu_memory_fraction} must be in (0, 1)")
