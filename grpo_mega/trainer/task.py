"""The builders of the two tasks that need the trainer's rewards (registered in grpo_mega.data.tasks.TASKS):
the toy successor task (make demo), with its own verifier or a reward model, and prompt files in verl's schema
scored by a reward (rule rewards in a process pool, or a learned reward model)."""

from __future__ import annotations

from grpo_mega.conf.reward import RewardConfig
from grpo_mega.conf.schema import TrainConfig
from grpo_mega.data.tasks import Task


def _reward_model(rew: RewardConfig, tok, verifier):
    """reward.name=reward_model: the batched reward model, with its label source and validation judge.
    `verifier`: the task's own rule reward (task=successor), or None."""
    from grpo_mega.rewards.reward_model import RewardModelReward
    from grpo_mega.rewards.scoring import PromptReward

    pool = dict(num_workers=rew.num_workers, timeout_s=rew.timeout_s, start_method=rew.start_method,
                max_memory_mb=rew.max_memory_mb)
    owned = []

    def rule(name: str, what: str, on_error: str):
        if name == "task":
            if verifier is None:
                raise ValueError(f"{what}=task needs task=successor (a task with its own verifier); with prompt "
                                 "files name a rule such as math, or a dotted path")
            return lambda examples, ids: [verifier(e, r) for e, r in zip(examples, ids)]
        r = PromptReward(tok, name, on_error=on_error, what="label source" if "labels" in what else "reward function",
                         **pool)
        owned.append(r)
        return lambda examples, ids: r.score_batch(examples, ids, list(range(len(examples))), 0)[0]

    labeler = rule(rew.rm_train.labels, "reward.rm_train.labels", "raise") if rew.rm_train.interval else None
    validate = None
    if rew.val_reward:
        judge = rule(rew.val_reward, "reward.val_reward", rew.on_error)
        validate = lambda example, ids: judge([example], [ids])[0]  # noqa: E731
    return RewardModelReward(tok, rew.path, rew.device, rew.rm_batch_size, rm_train=rew.rm_train, labeler=labeler,
                             label_name=rew.rm_train.labels, validate=validate, owned=owned)


def successor_task(cfg: TrainConfig, tok) -> Task:
    """task=successor, the demo: its own verifier, or reward.name=reward_model (with the verifier as labels)."""
    from grpo_mega.data.toy import SuccessorTask

    t = SuccessorTask(tok, seed=cfg.run.seed)
    reward = _reward_model(cfg.reward, tok, t.reward) if cfg.reward.name == "reward_model" else t.reward
    return Task(train_batch=t.train_batch, validation=t.validation, reward=reward, stop_token_ids=[tok.eos_token_id],
                get_state=t.get_state, set_state=t.set_state, save_files=getattr(reward, "save_files", None),
                load_files=getattr(reward, "load_files", None))


def prompts_task(cfg: TrainConfig, tok) -> Task:
    """task=prompts: data.train_files (and data.val_files) in verl's schema, scored by reward.name."""
    rew, batch, seed = cfg.reward, cfg.batch, cfg.run.seed
    from grpo_mega.data.dataset import PromptFile, PromptStream, load_prompts
    from grpo_mega.rewards.scoring import PromptReward

    tools = None
    if cfg.rollout.multi_turn.enable:  # the tools' schemas for the chat template; rows checked against them
        from grpo_mega.toolcalls import build_tools

        from grpo_mega.rollout.turns import check_tools_shown

        tools = {name: t.schema() for name, t in build_tools(cfg.rollout.multi_turn.tools).items()}
        check_tools_shown(tok, list(tools.values()), f" of {cfg.model}")
    cache = cfg.data.cache_dir or None
    train = PromptFile(cfg.data.train_files, tok, batch.max_prompt_length, tools, cache)  # indexed, read when drawn
    checked, _, dropped = train.check_head()
    if cfg.data.val_files:
        val = load_prompts(cfg.data.val_files, tok, batch.max_prompt_length, tools, cache)[0]
    else:  # a bounded, fixed sample of the training prompts, in file order (all of them when few)
        val = train.sample(cfg.eval.max_prompts, seed)
    if checked < len(train):
        print(f"{cfg.data.train_files}: {len(train)} rows, the first {checked} checked now, the others when drawn")
    elif dropped:
        print(f"dropped {dropped} prompts longer than batch.max_prompt_length={batch.max_prompt_length}")
    stream = PromptStream(train, seed)
    kwargs = {k: getattr(rew, k) for k in ("weights", "path") if getattr(rew, k)}
    if rew.name == "reward_model":
        reward = _reward_model(rew, tok, None)
    else:
        reward = PromptReward(tok, rew.name, kwargs, on_error=rew.on_error, num_workers=rew.num_workers,
                              timeout_s=rew.timeout_s, start_method=rew.start_method, max_memory_mb=rew.max_memory_mb)
    return Task(train_batch=stream.next_batch, validation=lambda: val, reward=reward,
                stop_token_ids=[tok.eos_token_id], get_state=stream.get_state, set_state=stream.set_state,
                save_files=getattr(reward, "save_files", None), load_files=getattr(reward, "load_files", None))
