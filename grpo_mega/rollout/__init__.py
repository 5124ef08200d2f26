"""Rollout engines (the interface, the embedded engine, SGLang) and the weight sync that feeds them."""
