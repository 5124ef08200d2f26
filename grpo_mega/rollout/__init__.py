"""Rollout scheduling over grpo_mega.engines: where and when samples are generated (placement, in turn, one step
ahead, asynchronous), multi-turn agent loops, routing each DP replica its rows."""
