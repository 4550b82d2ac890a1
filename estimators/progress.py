"""Training progress as printed by rank 0 (its output streams to the driver as ``[0] ...``),
and the driver's line on where a fit's time went (:class:`FitClock`).

Lines, not carriage returns: rank output reaches the driver line by line, so a bar
redrawn in place would arrive as one line per redraw anyway.  With ``verbose=1`` a line
is printed at most every ``interval_s`` seconds while an epoch runs, and one summary line
at its end; ``verbose=2`` prints about every 5% of the epoch as well.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from typing import Any, Callable, Dict, Mapping, Optional, TextIO

logger = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 10.0
BAR_WIDTH = 20


def format_metrics(logs: Mapping[str, Any]) -> str:
    """``loss 0.4012  accuracy 0.8811`` (numbers only, in the mapping's order)."""
    parts = []
    for name, value in logs.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            parts.append(f"{name} {value:.4f}" if isinstance(value, float) else f"{name} {value}")
    return "  ".join(parts)


def bar(done: int, total: int, width: int = BAR_WIDTH) -> str:
    """``[=======>............]`` for done/total."""
    if total <= 0:
        return "[" + "=" * width + "]"
    filled = min(width, int(width * done / total))
    head = ">" if filled < width else ""
    return "[" + "=" * filled + head + "." * (width - filled - len(head)) + "]"


class EpochProgress:
    """Progress of one epoch on one process (print only on rank 0)."""

    def __init__(self, epoch: int, epochs: int, steps: int, verbose: int = 1,
                 interval_s: float = DEFAULT_INTERVAL_S, stream: Optional[TextIO] = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.epoch, self.epochs, self.steps, self.verbose = epoch, epochs, steps, verbose
        self.interval_s = interval_s
        self.stream = stream
        self.clock = clock
        self.start = clock()
        self._last_print = self.start
        self._every = max(1, math.ceil(steps / 20)) if verbose >= 2 else 0

    def _head(self) -> str:
        width = len(str(self.epochs))
        return f"epoch {self.epoch + 1:>{width}}/{self.epochs}"

    def _print(self, line: str) -> None:
        print(line, file=self.stream or sys.stdout, flush=True)

    def update(self, step: int, loss: Callable[[], float]) -> None:
        """After ``step`` (1-based) steps; ``loss`` is called only when a line is due."""
        if self.verbose < 1 or step >= self.steps:
            return
        now = self.clock()
        due = now - self._last_print >= self.interval_s or \
            (self._every and step % self._every == 0)
        if not due:
            return
        self._last_print = now
        self._print(f"{self._head()}  {bar(step, self.steps)} {step}/{self.steps}  "
                    f"loss {loss():.4f}  {now - self.start:.1f}s")

    def finish(self, logs: Dict[str, Any]) -> float:
        """Print the epoch's summary line; returns its duration in seconds."""
        took = self.clock() - self.start
        if self.verbose >= 1:
            self._print(f"{self._head()}  {bar(self.steps, self.steps)} {self.steps}/"
                        f"{self.steps}  {took:.1f}s  {format_metrics(logs)}")
        return took


class FitClock:
    """Where a fit's time went, by phase (:data:`PHASES`): ``done(phase)`` adds the time
    since the last call to ``phase``; ``move`` hands seconds measured inside one phase (rank
    0's training and checkpoint writes, inside the launch) to another."""

    PHASES = ("checks", "data", "launch", "training", "checkpoints", "MLflow")

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.start = self.last = clock()
        self.seconds: Dict[str, float] = {}

    def done(self, phase: str) -> None:
        now = self.clock()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self.last
        self.last = now

    def move(self, source: str, phase: str, seconds: float) -> None:
        seconds = max(0.0, min(float(seconds), self.seconds.get(source, 0.0)))
        self.seconds[source] = self.seconds.get(source, 0.0) - seconds
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds

    def report(self, name: str, verbose: int) -> Dict[str, float]:
        """The seconds by phase (and ``total``), logged, and printed with ``verbose >= 1``
        as one line: ``TorchEstimator.fit: 9.1 s (checks 0.4 s, data 1.2 s, ...)``."""
        total = self.clock() - self.start
        phases = {k: self.seconds[k] for k in self.PHASES if k in self.seconds}
        line = f"{name}.fit: {total:.1f} s (" + ", ".join(
            f"{k} {v:.1f} s" for k, v in phases.items()) + ")"
        logger.info("%s", line)
        if verbose:
            print(line, flush=True)
        return dict(phases, total=total)
