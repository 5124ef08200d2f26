"""The RL algorithm (algo.*): advantages, the policy loss and its settings, KL, off-policy correction."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from grpo_mega.conf.rules import positive


@dataclass(kw_only=True)
class AlgoConfig:
    """The GRPO objective (docs/design.md, "The algorithm")."""

    policy_loss: str = "ppo_clip"
    """The policy loss, by name (grpo_mega.algo.POLICY_LOSSES): 'ppo_clip' (the clipped surrogate, with
    clip-higher and dual-clip), 'gspo' / 'gspo_token' (GSPO's sequence-level ratio and clip), 'cispo' (MiniMax-M1's
    clipped, stop-gradient IS weight on log pi), 'geo_mean' (GMPO: geometric mean of log-clipped token ratios),
    'sapo' (SAPO's smooth gate), 'gpg' (plain -A log pi), 'clip_cov' / 'kl_cov' (PPO with the gradient cut, or a KL
    added, on high-covariance tokens), 'dppo_tv' / 'dppo_kl' (DPPO: tokens outside a probability-divergence trust
    region leave the update), 'dro' (-A log pi plus a quadratic log-ratio penalty), 'bypass_ppo_clip' /
    'bypass_reinforce' (verl's bypass mode: the engine's logprobs are the old policy; ppo_clip on pi / pi_engine, or
    -A w log pi with the rollout correction's weight of pi / pi_engine). gspo, gspo_token, geo_mean and sapo need
    loss_agg_mode=seq-mean-token-mean."""
    ppo_epochs: int = 1
    """Passes over the step's responses."""
    clip_ratio_low: float = 0.2
    """eps_low of the clipped surrogate."""
    clip_ratio_high: float = 0.2
    """eps_high; > clip_ratio_low is DAPO's clip-higher."""
    dual_clip: Optional[float] = None
    """Dual-clip constant c > 1 for negative advantages (the loss of A < 0 is at most -c A), or null: off (verl
    always applies c = 3, its clip_ratio_c; docs/verl.md). ppo_clip, gspo and gspo_token."""
    gspo_clip_low: float = 3e-4
    """GSPO: eps_low on the sequence ratio s_i = exp(mean_t log(pi/pi_old)) (Zheng et al. 2025: 3e-4)."""
    gspo_clip_high: float = 4e-4
    """GSPO: eps_high on s_i (the paper's 4e-4)."""
    seq_log_ratio_cap: float = 10.0
    """Upper cap on a sequence-level log-ratio before its exp (gspo, gspo_token; verl's GSPO caps at 10): bounds a
    negative advantage's loss by |A| e^cap; no gradient above the cap."""
    cispo_eps_low: float = 1.0
    """CISPO: the IS weight is clipped below at 1 - cispo_eps_low (1.0: no lower bound, as MiniMax-M1)."""
    cispo_eps_high: float = 4.0
    """CISPO: the IS weight is clipped above at 1 + cispo_eps_high."""
    gmpo_clip_low: float = 0.4
    """geo_mean (GMPO): each token's log-ratio is clipped below at -gmpo_clip_low (the paper's ratio range
    (e^-0.4, e^0.4); verl reads clip_ratio_low here)."""
    gmpo_clip_high: float = 0.4
    """geo_mean: each token's log-ratio is clipped above at gmpo_clip_high."""
    sapo_tau_pos: float = 1.0
    """sapo: the gate's temperature for tokens with A > 0 (verl's tau_pos)."""
    sapo_tau_neg: float = 1.05
    """sapo: the gate's temperature for tokens with A <= 0 (verl's tau_neg)."""
    clip_cov_ratio: float = 2e-4
    """clip_cov: the share of a micro-batch's valid tokens whose policy-gradient term is dropped (at least 1)."""
    clip_cov_lb: float = 1.0
    """clip_cov: a token is a candidate when its advantage/log-prob covariance is in (clip_cov_lb, clip_cov_ub)."""
    clip_cov_ub: float = 5.0
    """clip_cov: the candidates' covariance upper bound."""
    kl_cov_ratio: float = 2e-4
    """kl_cov: the share of a micro-batch's valid tokens (largest covariance, at least 1) given the KL term."""
    kl_cov_coef: float = 0.1
    """kl_cov: the coefficient of |log r_t| on those tokens (verl's ppo_kl_coef)."""
    dppo_div_low: float = 0.2
    """dppo_tv / dppo_kl: the divergence threshold for tokens with A <= 0 (verl reads clip_ratio_low here)."""
    dppo_div_high: float = 0.2
    """dppo_tv / dppo_kl: the divergence threshold for tokens with A > 0 (verl reads clip_ratio_high here)."""
    dppo_is_cap: float = 20.0
    """dppo_tv / dppo_kl: the cap of the stop-gradient IS weight on kept tokens (verl's clip_ratio_c, 20 there)."""
    dro_beta: float = 1.0
    """dro: the coefficient beta of the quadratic penalty (beta / 2) (log pi - log pi_old)^2 (>= 0)."""
    kl_coef: float = 0.001
    """beta: weight of the KL term in the loss (0 disables the reference in the loss)."""
    kl_estimator: str = "k3"
    """k1, abs, k2 (mse), k3 (low_var_kl) or full (the whole-vocabulary KL from both models' logits: the
    reference runs in lockstep with the actor during the update; not with kl_in_reward)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus."""
    loss_agg_mode: str = "token-mean"
    """token-mean, seq-mean-token-sum, seq-mean-token-mean or seq-mean-token-sum-norm."""
    dapo_token_scale: bool = False
    """Scale each token's loss by 1 / (valid tokens of its response)."""
    adv_estimator: str = "grpo"
    """The advantage estimator (grpo_mega.algo.advantages.ADV_ESTIMATORS): 'grpo' (group mean and std),
    'rloo' (leave-one-out mean), 'reinforce_plus_plus_baseline' (group mean, then whitened over the batch's tokens),
    'grpo_passk' (only each group's best response, by its margin over the second best)."""
    norm_adv_by_std: bool = True
    """Divide advantages by the group std (false: DrGRPO); read by adv_estimator grpo and grpo_passk only."""
    global_adv_norm: bool = False
    """Divide advantages by their std over the whole batch (after any adv_estimator)."""
    early_stop_imp_ratio: Optional[float] = None
    """Skip a mini-batch with an importance ratio above this (or below its inverse); null: never."""
    ref_update_interval: Optional[int] = None
    """Iterative RL: copy the policy into the reference every this many steps; null: never."""
    ref_offload: bool = False
    """Keep the reference's weights in host memory between uses; they visit the GPU only for its forward
    (on GPUs; a no-op on CPU)."""
    kl_in_reward: bool = False
    """PPO-style: subtract beta * KL from the reward instead of adding it to the loss."""
    dynamic_sampling: Optional[str] = None
    """DAPO dynamic sampling (grpo_mega.algo.dynamic_sampling): 'filter' keeps groups whose rewards are all equal
    out of the loss; 'refill' generates more prompts until train_batch_size informative groups are held (or
    max_gen_rounds rounds ran); null: off (true/false, the setting's boolean form: filter/off)."""
    max_gen_rounds: int = 10
    """dynamic_sampling=refill: at most this many generation rounds per step (>= 1; 1: filter)."""
    recompute_old_logprobs: bool = False
    """Always run the old-logprob pass. By default it is skipped when the batch gets one optimizer step (ppo_epochs
    1, one mini-batch, no kl_in_reward, no rollout_is_batch_norm), off-policy steps and async included: the update's
    own logprobs, detached, are the old (proximal) ones (the loss and gradient are the same; one forward pass over
    the batch is saved)."""
    engine_is_cap: Optional[float] = None
    """Importance correction for rollout/trainer drift: weight each token's loss by
    min(p_trainer_old / p_engine, cap) (truncated importance sampling); null: off. The same as
    rollout_correction=token with rollout_correction_high=cap."""
    rollout_correction: Optional[str] = None
    """Rollout correction (grpo_mega.algo.correction): weight each token's loss by a function of
    rho = p_trainer_old / p_engine at level 'token', 'sequence' (the product over the response) or 'geometric'
    (its per-token geometric mean); or the preset 'icepop' (token level, mask outside [0.5, 5]); null: off."""
    rollout_correction_mode: Optional[str] = None
    """'truncate' (weight clip(rho, low, high)) or 'mask' (weight rho inside [low, high], 0 outside); null:
    truncate (icepop: mask)."""
    rollout_correction_low: Optional[float] = None
    """Lower bound on rho; null: 0 when truncating, 1/high when masking (icepop: 0.5)."""
    rollout_correction_high: Optional[float] = None
    """Upper bound on rho (> low); null: 2.0 (icepop: 5.0)."""
    rollout_rejection: Optional[str] = None
    """Rejection on a divergence statistic of lr_t = log rho_t (verl's rollout_rs): 'token_k2', 'token_k3' (per
    token: lr^2 / 2, e^lr - 1 - lr), 'seq_sum_k2/k3', 'seq_mean_k2/k3', 'seq_max_k2/k3' (its sum, mean or max over
    the response: the whole response is rejected). A rejected token's weight is 0 (it stays in the normaliser); a
    kept one keeps the correction's weight (1 without rollout_correction). null: off. The k1 rejections are
    rollout_correction_mode=mask."""
    rollout_rejection_threshold: Optional[float] = None
    """The largest kept value of rollout_rejection's statistic (> 0; required with it)."""
    rollout_is_batch_norm: bool = False
    """Divide the rollout correction's weights by their mean over the step's response tokens (token level) or
    responses (sequence, geometric), before any rejection (verl's rollout_is_batch_normalize). Needs a correction;
    runs the old-logprob pass before the update."""
    routing_replay: str = "none"
    """MoE models: 'rollout' (R3) routes each token in the trainer's passes to the top-k experts the rollout engine
    chose for it (prompt and response; grpo_mega.models.routing_replay); 'measure': the engine's choices are
    recorded and only compared (moe/routing_agreement logged), the trainer routes on its own: whether replay is
    needed; 'none': the trainer routes on its own, nothing recorded."""

    def __post_init__(self):
        from grpo_mega.algo.kl import KL_ESTIMATORS
        from grpo_mega.algo.loss import AGG_MODES
        from grpo_mega.algo.policy_loss import POLICY_LOSSES, check_settings

        from grpo_mega.algo.advantages import ADV_ESTIMATORS

        POLICY_LOSSES.get(self.policy_loss)
        ADV_ESTIMATORS.get(self.adv_estimator)
        KL_ESTIMATORS.get(self.kl_estimator)
        AGG_MODES.get(self.loss_agg_mode)
        check_settings(self.policy_loss, self.loss_agg_mode, self.dual_clip)
        positive("algo.ppo_epochs", self.ppo_epochs)
        if self.clip_ratio_low < 0 or self.clip_ratio_high < 0:
            raise ValueError(f"algo.clip_ratio_low={self.clip_ratio_low} and clip_ratio_high={self.clip_ratio_high} must be >= 0")
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise ValueError(f"algo.dual_clip={self.dual_clip} must be > 1 (or null)")
        if self.kl_in_reward and self.kl_estimator == "full":
            raise ValueError("algo.kl_estimator='full' with algo.kl_in_reward=true: the reward's KL is estimated "
                             "from the sampled tokens' logprobs; use k1, abs, k2 or k3 there, or "
                             "kl_in_reward=false for the full KL in the loss")
        if self.engine_is_cap is not None and self.engine_is_cap < 1:
            raise ValueError(f"algo.engine_is_cap={self.engine_is_cap} must be >= 1 (or null)")
        if self.early_stop_imp_ratio is not None and self.early_stop_imp_ratio <= 1:
            raise ValueError(f"algo.early_stop_imp_ratio={self.early_stop_imp_ratio} must be > 1 (or null)")
        self.correction()
        from grpo_mega.algo.dynamic_sampling import resolve_mode

        self.dynamic_sampling = resolve_mode(self.dynamic_sampling)
        if self.max_gen_rounds < 1:
            raise ValueError(f"algo.max_gen_rounds={self.max_gen_rounds} must be >= 1 (the step's first round counts)")
        if self.routing_replay not in ("none", "measure", "rollout"):
            raise ValueError(f"algo.routing_replay={self.routing_replay!r} must be 'none', 'measure' or 'rollout'")
        if not 0.0 <= self.cispo_eps_low <= 1.0 or self.cispo_eps_high < 0:
            raise ValueError(f"algo.cispo_eps_low={self.cispo_eps_low} must be in [0, 1] and "
                             f"algo.cispo_eps_high={self.cispo_eps_high} >= 0")
        if self.gspo_clip_low < 0 or self.gspo_clip_high < 0:
            raise ValueError(f"algo.gspo_clip_low={self.gspo_clip_low} and gspo_clip_high={self.gspo_clip_high} "
                             f"must be >= 0")
        if not self.seq_log_ratio_cap > 0:
            raise ValueError(f"algo.seq_log_ratio_cap={self.seq_log_ratio_cap} must be > 0 (verl's GSPO uses 10)")
        if self.policy_loss == "bypass_ppo_clip" and self.correction() is not None:
            raise ValueError("algo.policy_loss='bypass_ppo_clip' clips r = p / p_engine, its own importance "
                             "correction: unset algo.rollout_correction and algo.engine_is_cap (rollout_rejection "
                             "applies), or use bypass_reinforce for an explicit weight")
        if self.policy_loss.startswith("bypass_") and self.rollout_is_batch_norm:
            raise ValueError(f"algo.policy_loss={self.policy_loss!r} with algo.rollout_is_batch_norm=true: the batch "
                             f"mean is of p_old / p_engine, which bypass mode does not use; set it false")
        self.objective()  # the loss's own checks (grpo_mega.algo.policy_loss.Objective), at start-up

    def objective(self):
        """The policy loss's settings (grpo_mega.algo.policy_loss.Objective): every field of it read from the
        field of the same name here, the one place the loss reads the config."""
        from dataclasses import fields

        from grpo_mega.algo.policy_loss import Objective

        return Objective(**{f.name: getattr(self, f.name) for f in fields(Objective) if not f.metadata.get("runtime")})

    @property
    def records_routes(self) -> bool:
        """The engine returns the experts it chose (routing_replay 'rollout' replays them, 'measure' compares)."""
        return self.routing_replay != "none"

    def correction(self):
        """The rollout correction (level, mode, low, high) these fields resolve to, or None when off
        (grpo_mega.algo.correction.resolve; engine_is_cap is its token-level truncation)."""
        from grpo_mega.algo.correction import resolve

        return resolve(self.rollout_correction, self.rollout_correction_mode, self.rollout_correction_low,
                       self.rollout_correction_high, self.engine_is_cap)
