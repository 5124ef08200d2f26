"""One-off campaigns: each shows one claim end to end and writes its result to bench_results/ (README.md in this
folder: what each shows, its command, its JSON). Run from the repository's root: `python -m experiments.<name>`.
`proxies` holds the forwarding HTTP proxies that the campaigns and the tests put in front of a rollout server."""
