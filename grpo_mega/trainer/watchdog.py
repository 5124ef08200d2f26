"""A hang leaves a stack dump: each step arms faulthandler's own watchdog thread for max(watchdog_min_s,
watchdog_factor x the median step so far); a step that runs past it writes every thread's stack into
stacks-rank<R>.txt in the run directory (removed at the end when empty; the run goes on: a slow step is not killed, the collective's own
timeout, dist.timeout_s, decides that). docs/design.md, "timeouts"."""

from __future__ import annotations

import faulthandler
import statistics
import time
from pathlib import Path
from typing import Optional


class StepWatchdog:
    def __init__(self, path: Path, factor: float, min_s: float):
        self.path, self.factor, self.min_s = Path(path), factor, min_s
        self.durations: list[float] = []
        self._file = None
        self._t0: Optional[float] = None

    @property
    def enabled(self) -> bool:
        return self.factor > 0

    def threshold(self) -> float:
        """Seconds a step may run before its stacks are dumped."""
        median = statistics.median(self.durations) if self.durations else 0.0
        return max(self.min_s, self.factor * median)

    def begin(self) -> None:
        if not self.enabled:
            return
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a")
        self._t0 = time.monotonic()
        faulthandler.dump_traceback_later(self.threshold(), repeat=False, file=self._file, exit=False)

    def end(self) -> None:
        if not self.enabled or self._t0 is None:
            return
        faulthandler.cancel_dump_traceback_later()
        self.durations.append(time.monotonic() - self._t0)
        self._t0 = None

    def close(self) -> None:
        """Disarm; a dump file with nothing in it (no step ever hung) is removed."""
        if self._file is not None:
            faulthandler.cancel_dump_traceback_later()
            self._file.close()
            self._file = None
            if self.path.stat().st_size == 0:
                self.path.unlink()
