# The body shared by the large-model launch scripts (qwen2.5-7b.sh, llama-3.1-70b.sh, qwen2.5-72b.sh, qwen3-8b.sh,
# qwen3-32b.sh, qwen3-30b-a3b.sh, qwen3-235b-a22b.sh and the -lora ones), sourced by each after it has set its own layout: NODES, MODEL,
# TP, PP, (EP,) MICRO_BATCH, ENGINE_TP and ENGINES. This file
# sets the defaults they share and builds `overrides`, the Hydra overrides the script hands to
# slurm/train.sbatch; the script itself then runs `exec sbatch ...` (grpo-mega-plan --from-launch-script looks
# for that line in the script it is given). Not run on its own.
DATA=${DATA:-$HOME/data/gsm8k/train.parquet}  # prompts in verl's schema, .parquet or .jsonl
VAL_DATA=${VAL_DATA:-}                        # default: the training file
STEPS=${STEPS:-200}
RECOMPUTE=${RECOMPUTE:-none}
EP=${EP:-1}                                   # expert parallelism (MoE models)
PROMPTS=${PROMPTS:-64} N=${N:-8} MINI_BATCH=${MINI_BATCH:-16}
PROMPT_LEN=${PROMPT_LEN:-1024} RESPONSE_LEN=${RESPONSE_LEN:-3072}
LR=${LR:-1e-6} KL_COEF=${KL_COEF:-0.001}
CKPT_INTERVAL=${CKPT_INTERVAL:-20}            # checkpoints: slurm/train.sbatch keeps them per job name
ENGINE_MEM=${ENGINE_MEM:-0.3}                 # each SGLang engine's share of every GPU it runs on

SEQUENCE_PARALLEL=true
if (( TP == 1 )); then SEQUENCE_PARALLEL=false; fi  # sequence parallelism splits over TP: none at TP1

overrides=(
  task=prompts "model=$MODEL" "data.train_files=$DATA" reward.name=math
  parallel.tp="$TP" parallel.pp="$PP" parallel.ep="$EP" parallel.sequence_parallel="$SEQUENCE_PARALLEL"
  parallel.recompute="$RECOMPUTE"
  precision.params_dtype=bf16 optim.use_distributed_optimizer=true
  optim.lr="$LR" optim.weight_decay=0.01 optim.clip_grad=1.0 optim.lr_warmup_steps=10
  algo.kl_coef="$KL_COEF" algo.kl_estimator=k3 algo.loss_agg_mode=token-mean
  batch.train_batch_size="$PROMPTS" rollout.n="$N" batch.ppo_mini_batch_size="$MINI_BATCH"
  batch.micro_batch_size="$MICRO_BATCH" batch.max_prompt_length="$PROMPT_LEN" batch.max_response_length="$RESPONSE_LEN"
  rollout.engine=sglang rollout.engine_tp="$ENGINE_TP" rollout.gpu_memory_fraction="$ENGINE_MEM"
  rollout.num_engines="$ENGINES"
  rollout.temperature=1.0 run.steps="$STEPS" eval.interval=10
  checkpoint.interval="$CKPT_INTERVAL"
)
if [[ -n "$VAL_DATA" ]]; then overrides+=("data.val_files=$VAL_DATA"); fi  # (as the last line, `[[ ]] &&` would fail the `source`)
