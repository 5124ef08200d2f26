"""`python -m grpo_mega.cli.torchrun [torchrun options] -m grpo_mega.train [overrides]` (or `grpo-mega-torchrun`): torchrun
(torch.distributed.run, unchanged) with the exit status a bad input deserves.

torchrun does not pass its workers' exit statuses on: when one fails it logs a report of every rank (about 30 lines
with a traceback of its own) and exits 1. grpo_mega.train refuses a bad input with one line and exit status 2 (said
by rank 0 alone when every rank refuses the same input before torch.distributed starts, as a config or a layout).
Here, when the first worker to fail exited 2, that line is all there is: torchrun's report is dropped and the
status is 2. Any other failure keeps torchrun's report and its status. OMP_NUM_THREADS defaults to 1, torchrun's own
default, without its banner. slurm/train.sbatch and launch_scripts/ start their ranks with it."""

from __future__ import annotations

import logging
import os
import sys

INPUT_ERROR = 2
"""grpo_mega.train's exit status for a bad input (grpo_mega.train.EXIT_INPUT)."""
_REPORTERS = ("torch.distributed.elastic.multiprocessing.api", "torch.distributed.elastic.agent.server.api",
              "torch.distributed.elastic.multiprocessing.errors", "torch.distributed.run")


class _HeldBack(logging.Filter):
    """Holds torchrun's warnings (the failed and stopped workers) until it is known why the workers failed."""

    def __init__(self):
        super().__init__()
        self.held: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING:
            self.held.append(record)
            return False
        return True


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    held = _HeldBack()
    loggers = [logging.getLogger(name) for name in _REPORTERS]
    for log in loggers:
        log.addFilter(held)
    try:
        torchrun(argv)
    except ChildFailedError as e:
        if e.get_first_failure()[1].exitcode == INPUT_ERROR:
            return INPUT_ERROR  # the worker said what was wrong, in one line
        _release(held, loggers)
        raise
    _release(held, loggers)
    return 0


def _release(held: _HeldBack, loggers: list[logging.Logger]) -> None:
    for log in loggers:
        log.removeFilter(held)
    for record in held.held:
        logging.getLogger(record.name).handle(record)


if __name__ == "__main__":
    sys.exit(main())
