"""The root config: TrainConfig, one field per component (each its own module under grpo_mega/conf/, each field
documented, each rule checked in its `__post_init__` with a message that names the field, the value and the rule),
and the checks that need two components (`check_layout` and the others here). Hydra composes these; nothing
under conf/ imports torch.distributed or megatron.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from grpo_mega.conf.model import ModelConfig
from grpo_mega.conf.parallel import ParallelConfig
from grpo_mega.conf.lora import MOE_TARGETS, LoraConfig
from grpo_mega.conf.optim import OptimConfig, PrecisionConfig
from grpo_mega.conf.algo import AlgoConfig
from grpo_mega.conf.batch import BatchConfig
from grpo_mega.conf.rollout import RolloutConfig
from grpo_mega.conf.run import CheckpointConfig, DataConfig, DistConfig, EvalConfig, RunConfig
from grpo_mega.conf.reward import RewardConfig

SGLANG_READS_BACK = ("llama",)
"""Model families whose SGLang model class has get_weights_by_name (SGLang 0.5.23: Llama's; not Qwen2's or
Qwen3's), which rollout.audit_weights needs."""


@dataclass(kw_only=True)
class TrainConfig:
    """The whole run, composed by Hydra (grpo_mega/conf/config.yaml, the task's grpo_mega/conf/task/<task>.yaml,
    then command-line overrides): every field of
    every component is overridable (`algo.entropy_coef=0.01`). Each component checks its own fields; the
    checks that need two of them run here, before any model is built."""

    model: str = "tiny"
    """A model_configs/ name (random init), or an HF directory (weights and tokenizer loaded from it)."""
    task: str = "successor"
    """'successor' (the toy demo), 'product_tool' (the toy tool task: 2-digit products, solvable with
    rollout.multi_turn's calculator), 'tens_tool' (the tens digit of such a product), 'lookup_tool' (the letter
    stored under a key, which only the tool knows; grpo_mega.data.toy_tools), 'lookup_call' (its warm-up: a
    shaping reward for calling the tool, not a measure), 'prompts' (data.* files scored by reward.*): the names
    in grpo_mega.data.tasks.TASKS; or `pkg.module:function`, a builder (cfg, tokenizer) -> Task. On the command
    line `task=` also picks the task's settings, grpo_mega/conf/task/<task>.yaml: the toy tasks run with the demo's
    (successor.yaml), task=prompts with these defaults."""
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    run: RunConfig = field(default_factory=RunConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)

    def __post_init__(self):
        for f in fields(self):  # plain dicts (a checkpoint's saved config) become their dataclasses
            kind = _COMPONENTS.get(f.name)
            if kind is not None and isinstance(getattr(self, f.name), dict):
                setattr(self, f.name, kind(**getattr(self, f.name)))
        from grpo_mega.data.tasks import task_spec

        task_spec(self.task)  # a registered task (grpo_mega.data.tasks.TASKS) or module:function
        if self.task == "prompts" and not self.data.train_files:
            raise ValueError("task=prompts needs data.train_files=PATH (.jsonl or .parquet in verl's schema)")
        self.batch.check_packing(self.parallel)
        buffer = self.reward.overlong_buffer_len
        if buffer is not None and buffer > self.batch.max_response_length:
            raise ValueError(f"reward.overlong_buffer_len={self.reward.overlong_buffer_len} must be <= "
                             f"batch.max_response_length={self.batch.max_response_length} (the buffer is its last "
                             f"tokens)")
        if self.reward.rm_train.interval and self.algo.ref_update_interval is None:
            # Iterative RL (Algorithm 1): the reference follows the reward model's updates.
            self.algo.ref_update_interval = self.reward.rm_train.interval
        if self.algo.dynamic_sampling == "refill" and self.reward.rm_train.interval:
            raise ValueError(f"algo.dynamic_sampling=refill with reward.rm_train.interval={self.reward.rm_train.interval}: "
                             "refill scores a step in several rounds and the reward model would train on each; "
                             "use algo.dynamic_sampling=filter, or reward.rm_train.interval=0")
        if self.rollout.mode == "async":
            self.check_async()
        if self.rollout.replay_dir and (self.checkpoint.dir or self.algo.dynamic_sampling == "refill"):
            raise ValueError("rollout.replay_dir with " + ("checkpoint.dir: a replay does not resume; drop checkpoint.dir"
                                                           if self.checkpoint.dir else "algo.dynamic_sampling=refill: "
                                                           "only the trained samples were dumped; use filter"))
        if self.lora.enabled:
            self.check_lora()
        bypass_clip = self.algo.policy_loss == "bypass_ppo_clip"
        if self.rollout.off_policy_steps and self.algo.correction() is None and not bypass_clip:
            # One step behind: truncated importance correction against the engine's logprobs covers the lag
            # (bypass_ppo_clip's ratio is already against the engine's logprobs).
            self.algo.engine_is_cap = OFF_POLICY_IS_CAP

    def check_async(self) -> None:
        """What rollout.mode=async does not do yet, each refused in one line."""
        why = None
        if self.algo.dynamic_sampling == "refill":
            why = ("algo.dynamic_sampling=refill (extra rounds of one step's prompts) has no meaning with a continuous "
                   "stream of groups; use algo.dynamic_sampling=filter")
        elif self.rollout.multi_turn.enable:
            why = "rollout.multi_turn.enable=true: multi-turn trajectories are not generated in segments yet"
        if why is not None:
            raise ValueError(f"rollout.mode=async with {why}")

    def check_layout(self, model: ModelConfig, world_size: int) -> int:
        """The layout against the model and the launched world: returns dp, or a ValueError naming the field."""
        if model.is_moe and self.parallel.tp > 1 and not self.parallel.sequence_parallel:
            raise ValueError(f"parallel.tp={self.parallel.tp} with an MoE model needs parallel.sequence_parallel=true "
                             "(megatron-core's MoE layer refuses tensor parallelism without it in training)")
        self.check_routing_replay(model)
        moe_targets = [t for t in self.lora.target_modules if t in MOE_TARGETS]
        if self.lora.enabled and moe_targets and not model.is_moe:
            raise ValueError(f"lora.target_modules {moe_targets} need an MoE model; model {model.name} is dense (no "
                             "num_experts): leave them out of lora.target_modules")
        dp = self.parallel.check(model, world_size)
        self.batch.check_layout(self.parallel, dp, self.rollout.n)
        if world_size % self.rollout.num_engines:
            raise ValueError(f"rollout.num_engines={self.rollout.num_engines} must divide the number of ranks "
                             f"({world_size}): the engines sit on evenly spaced ranks (one per node)")
        if (self.rollout.audit_weights and self.rollout.engine == "sglang" and self.rollout.placement == "colocated"
                and model.family not in SGLANG_READS_BACK):
            raise ValueError(f"rollout.audit_weights=true reads every tensor back with SGLang's get_weights_by_name, "
                             f"which SGLang implements for {', '.join(SGLANG_READS_BACK)} models, not "
                             f"model.family={model.family!r}: set rollout.audit_weights=false (the engine/trainer "
                             "logprob mismatch metric still checks the weights) or use rollout.engine=embedded")
        return dp

    def check_lora(self) -> None:
        """What LoRA cannot be combined with yet: a ValueError naming the setting."""
        r = self.lora.rank
        if self.algo.ref_update_interval:
            raise ValueError(f"lora.rank={r} with algo.ref_update_interval={self.algo.ref_update_interval}: under LoRA the "
                             "reference is the frozen base (the actor with adapters off) and cannot follow the policy; "
                             "set algo.ref_update_interval=null or lora.rank=null")
        if self.precision.fp8 is not None:
            raise ValueError(f"lora.rank={r} with precision.fp8={self.precision.fp8!r}: LoRA runs on megatron-core's "
                             "local layers (chosen even where Transformer Engine is installed), FP8 only on Transformer "
                             "Engine's; set precision.fp8=null or lora.rank=null")

    def check_routing_replay(self, model: ModelConfig) -> None:
        """algo.routing_replay=rollout or measure against the model and the engines: a ValueError naming what
        refuses it (both need the engine's routes; measure counts in every router call, as replay routes)."""
        if self.algo.routing_replay == "none":
            return
        mode = self.algo.routing_replay
        if not model.is_moe:
            raise ValueError(f"algo.routing_replay={mode} needs an MoE model; model {model.name} is "
                             f"dense (family {model.family!r}, no num_experts): set algo.routing_replay=none")
        if self.rollout.engine != "embedded" and self.rollout.placement == "colocated":
            raise ValueError(f"algo.routing_replay={mode} with the colocated rollout.engine={self.rollout.engine}: its "
                             "routed experts are not read yet (SGLang 0.5.23 returns them to dedicated servers' clients, "
                             "rollout.placement=dedicated, started with --enable-return-routed-experts); use "
                             "rollout.engine=embedded or rollout.placement=dedicated")
        if self.rollout.multi_turn.enable:
            raise ValueError(f"algo.routing_replay={mode} with rollout.multi_turn.enable=true: tool turns are not "
                             "recorded yet; set algo.routing_replay=none")
        if self.parallel.recompute == "full":
            raise ValueError(f"algo.routing_replay={mode} with parallel.recompute=full: a recomputed layer would route "
                             "again with another micro-batch's experts (and be counted again); use "
                             "parallel.recompute=selective or none")

    @classmethod
    def from_hydra(cls, cfg) -> "TrainConfig":
        """The typed config from Hydra's composed DictConfig (each component validating itself)."""
        from omegaconf import OmegaConf

        c = OmegaConf.to_container(cfg, resolve=True)
        c.pop("hydra", None)
        return cls(**c)

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def skips_old_logprob_pass(self) -> bool:
        """One optimizer step per batch (one epoch, one mini-batch), and nothing reads the old logprobs before the
        update: the update's own forward runs on the weights the pass would (the proximal policy, whatever version
        generated the samples), so its logprobs, detached, are the old ones (algo.recompute_old_logprobs)."""
        a = self.algo
        return (a.ppo_epochs == 1 and self.batch.mini_batches_per_step == 1 and not a.kl_in_reward
                and not a.recompute_old_logprobs and not a.rollout_is_batch_norm)

    def shaping(self):
        """The settings of the per-step shaping (grpo_mega.algo.shaping), as plain values."""
        from grpo_mega.algo.shaping import StepShaping

        a = self.algo
        return StepShaping(n=self.rollout.n, overlong=self.reward.overlong, kl_in_reward=a.kl_in_reward,
                           overlong_buffer_len=self.reward.overlong_buffer_len,
                           overlong_penalty_factor=self.reward.overlong_penalty_factor,
                           max_response_length=self.batch.max_response_length,
                           kl_coef=a.kl_coef, kl_estimator=a.kl_estimator, adv_estimator=a.adv_estimator,
                           norm_adv_by_std=a.norm_adv_by_std,
                           global_adv_norm=a.global_adv_norm, dynamic_sampling=bool(a.dynamic_sampling))


OFF_POLICY_IS_CAP = 2.0
"""algo.engine_is_cap when rollout.off_policy_steps=1 and none is set (verl's TIS default)."""

_COMPONENTS = {"data": DataConfig, "reward": RewardConfig, "parallel": ParallelConfig, "precision": PrecisionConfig,
               "optim": OptimConfig, "algo": AlgoConfig, "batch": BatchConfig, "rollout": RolloutConfig,
               "run": RunConfig, "eval": EvalConfig, "checkpoint": CheckpointConfig, "dist": DistConfig,
               "lora": LoraConfig}

RENAMED = {"batch.n": "rollout.n", "seed": "run.seed"}
"""Settings that had two names: the old one is refused, naming the new."""


def check_renamed(overrides: list[str]) -> None:
    """A ValueError for a command-line override that uses a setting's old name."""
    for o in overrides:
        key = o.split("=", 1)[0].lstrip("+~")
        if key in RENAMED:
            raise ValueError(f"{key} is now {RENAMED[key]}: write {RENAMED[key]}={o.split('=', 1)[1] if '=' in o else '...'}")


def register_schema() -> None:
    """TrainConfig in Hydra's ConfigStore as `train_schema`, the schema grpo_mega/conf/config.yaml composes against:
    whoever composes the config (the entry point, the planner, the SGLang launcher, tests) calls this, so none of
    them imports the entry point for it. Idempotent."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="train_schema", node=TrainConfig)
