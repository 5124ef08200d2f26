"""Rollout engines: the interface, the embedded engine, SGLang (in process or as servers), the client, the
checks on what they return, and the weight sync that feeds them."""
