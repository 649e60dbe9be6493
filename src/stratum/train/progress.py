"""What a person watching the run sees: a rich progress bar on a terminal, plain lines otherwise (through the
``stratum.train.progress`` logger, so a log file or a launcher's log collects them)."""

from __future__ import annotations

import logging
import sys

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

logger = logging.getLogger(__name__)


class StepDisplay:
    def __init__(self, console: Console, *, total: int, start: int, log_interval: int):
        self.console = console
        self.total = total
        self.log_interval = log_interval
        self._bar = None
        if console.is_terminal:
            self._bar = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[info]}"), TimeRemainingColumn(), console=console)
            self._task = self._bar.add_task("train", total=total, completed=start, info="")
            self._bar.start()

    def step(self, rec: dict) -> None:
        info = (f"loss {rec['loss']:.4f}  {rec['tokens_per_s']:,.0f} tok/s  {rec['tflops']:.3f} TFLOP/s"
                + (f"  eval {rec['eval_loss']:.4f}" if "eval_loss" in rec else ""))
        if self._bar is not None:
            self._bar.update(self._task, completed=rec["step"], info=info)
            if "eval_loss" in rec:
                self._bar.console.print(f"step {rec['step']:>6}: eval loss {rec['eval_loss']:.4f}")
        elif rec["step"] % self.log_interval == 0 or rec["step"] == self.total or "eval_loss" in rec \
                or rec["step"] == 1:
            logger.info(f"step {rec['step']:>6}/{self.total}  lr {rec['lr']:.2e}  {info}")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


def make_console() -> Console:
    return Console(file=sys.stdout, highlight=False, soft_wrap=True)
