"""Benchmarks: each module measures one thing and writes bench_results/<name>.json (`python -m bench.<name>`
from the repository's root; `--help` lists its knobs). `common` is what they share (the machine, memory probes,
timing, a measurement or a training run in a fresh process, writing the JSON); `table` renders the README's
benchmark table from the JSONs. docs/benchmarks.md says what each measures and what the numbers mean."""
