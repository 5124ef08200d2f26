"""run.memory_sites: the allocation trace replayed to its peak and summed by the line that asked (a trace written
as torch.cuda.memory._snapshot() gives it; the recording itself needs CUDA)."""

import pytest

from grpo_mega.conf.run import RunConfig
from grpo_mega.trainer.memory import MemorySites, top_allocation_sites

SITE = "/venv/lib/python3.11/site-packages/"


def _frames(*where):
    return [dict(filename=f, line=line, name=name) for f, line, name in where]


LINEAR = (SITE + "torch/nn/modules/linear.py", 125, "forward")
ACTOR = ("/repo/grpo_mega/trainer/actor.py", 88, "update")
ADAM = (SITE + "torch/optim/adam.py", 40, "_init_group")
BUILD = ("/repo/grpo_mega/trainer/optimizer.py", 30, "build")


def _alloc(addr, size, *where):
    return dict(action="alloc", addr=addr, size=size, frames=_frames(*where))


def _free(addr):
    return dict(action="free_requested", addr=addr, size=0, frames=[])


def test_the_peak_is_summed_by_the_innermost_line_outside_torch():
    trace = [
        _free(99),  # allocated before recording began: ignored
        _alloc(1, 300, ADAM, BUILD),  # Adam's states: stay
        _alloc(2, 500, LINEAR, ACTOR),  # an activation
        _alloc(3, 200, LINEAR, ACTOR),  # another, same line
        _alloc(4, 50, ADAM, BUILD),
        _free(2),  # peak (1050) was before this
        _alloc(5, 100, ACTOR),  # after the peak: not counted
        _alloc(6, 7),  # no stack
    ]
    out = top_allocation_sites({"device_traces": [[], trace]}, n=5, device=1, max_entries=8)
    assert out["peak_gib_since_recording"] == 1050 / 2**30
    assert out["trace_events"] == 8 and out["trace_truncated"] and out["sites_at_peak"] == 2
    actor, build = out["top"]
    assert actor["site"] == "/repo/grpo_mega/trainer/actor.py:88 update"
    assert actor["via"] == "torch/nn/modules/linear.py:125 forward"
    assert (actor["gib"], actor["blocks"], actor["largest_block_gib"]) == (700 / 2**30, 2, 500 / 2**30)
    assert build["site"].endswith("optimizer.py:30 build") and build["gib"] == 350 / 2**30
    assert top_allocation_sites({"device_traces": [[], trace]}, n=1, device=1)["top"] == [actor]
    assert top_allocation_sites({})["top"] == []


def test_without_a_gpu_nothing_is_recorded_and_it_says_so(tmp_path, capsys):
    sites = MemorySites(3, tmp_path)
    assert sites.report(1) is None and list(tmp_path.iterdir()) == []
    assert "run.memory_sites=3 records CUDA allocations: this run has no GPU" in capsys.readouterr().out
    MemorySites(0, tmp_path)
    assert capsys.readouterr().out == ""
    with pytest.raises(ValueError, match=r"run.memory_sites=-1 must be an integer >= 0"):
        RunConfig(memory_sites=-1)
