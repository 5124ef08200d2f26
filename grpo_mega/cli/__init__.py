"""The user commands, installed as console scripts (pyproject.toml [project.scripts]) and runnable as
`python -m grpo_mega.cli.<name>`: `convert_to_mcore` (HF -> Megatron checkpoint), `convert_to_hf` (Megatron
checkpoint -> HF), `plan` (memory per GPU of a layout) and `prepare_model` (SmolLM2-135M-Instruct as an HF
directory). Each parses its arguments and calls into the package; the work is done there."""
