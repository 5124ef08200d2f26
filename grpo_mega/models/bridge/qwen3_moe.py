"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): config.json mapping. Attention is Qwen3's (q/k norms, no
biases); the MLP of every layer that decoder_sparse_step and mlp_only_layers select is a router
(`mlp.gate`, [num_experts, hidden], no bias) and num_experts SwiGLU experts (`mlp.experts.{j}.*_proj`),
mapped in common.py to megatron's `mlp.router` and `mlp.experts.local_experts.{j}` (SequentialMLP).
transformers 5 holds the experts fused in memory but reads and writes this per-expert layout on disk.
"""

from grpo_mega.models.bridge.qwen3 import Qwen3


class Qwen3Moe(Qwen3):
    family = "qwen3_moe"
    model_type = "qwen3_moe"
    architectures = ("Qwen3MoeForCausalLM",)

    def _extra_model_fields(self, hf: dict, name: str) -> dict:
        # transformers 5 writes num_local_experts (its attribute map), 4.x num_experts
        experts = hf.get("num_experts", hf.get("num_local_experts"))
        if not experts:
            raise ValueError(f"{name}: a qwen3_moe config.json without num_experts (or num_local_experts)")
        if hf.get("shared_expert_intermediate_size"):
            raise ValueError(f"{name}: shared experts (shared_expert_intermediate_size) are Qwen2-MoE's, not Qwen3-MoE's")
        return dict(
            num_experts=int(experts),
            moe_router_topk=int(hf.get("num_experts_per_tok", 8)),
            moe_ffn_hidden_size=int(hf["moe_intermediate_size"]),
            moe_norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            decoder_sparse_step=int(hf.get("decoder_sparse_step", 1)),
            mlp_only_layers=list(hf.get("mlp_only_layers") or []),
            moe_aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.001)),
        )

    def _extra_hf_config(self, cfg, out: dict) -> dict:
        out = super()._extra_hf_config(cfg, out)
        out.update(
            num_experts=cfg.num_experts,
            num_experts_per_tok=cfg.moe_router_topk,
            moe_intermediate_size=cfg.moe_ffn_hidden_size,
            norm_topk_prob=cfg.moe_norm_topk_prob,
            decoder_sparse_step=cfg.decoder_sparse_step,
            mlp_only_layers=list(cfg.mlp_only_layers),
            router_aux_loss_coef=cfg.moe_aux_loss_coeff,
            output_router_logits=False,
        )
        return out
