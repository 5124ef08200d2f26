"""The GRPO step: the actor and reference under Megatron (actor.py), the step's batch (batch.py)."""
