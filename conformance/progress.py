"""What ``mlaspec check`` shows while its cases run: a progress bar on a terminal, a few count lines in a log.

stdout carries only the lines worth keeping, the same whether or not a person watches:

* ``[ i/n] RUN   <reproducer>`` *before* each announced case runs (the drawn ones of ``--generated``, a ``--params``
  case): a kernel that takes the process down (an illegal address, in ``--isolation none``) leaves the command
  that reruns it on stdout, flushed, as the last line the run wrote there;
* ``[ i/n] FAIL  <case id>`` when a case is judged, for a case that did not pass or skip and for every announced
  case (every case with ``--verbose``).

The rest depends on whether stderr is a terminal (:func:`draws_a_bar`):

* it is: one tqdm bar on stderr, its description the id of the case now running, redrawn *before* the case runs.
  A process that dies leaves the bar as it last drew it, so the culprit's id (a curated case's reproducer is
  ``--case ID``) stays on the screen. Lines for stdout are written through ``tqdm.write``, which takes the bar off,
  writes the line and draws the bar again below it, so the two never tear each other;
* it is not (a CI log, ``2>file``): no bar, no carriage returns, and a count line
  (``[ 30/300] 28 passed, 1 failed, 0 errors, 1 skipped``) after every tenth of the cases, at least 25 cases apart:
  at most nine, so a log shows the run is alive without a line per case.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import TextIO

from .cases import Case
from .report import verdict_counts
from .verdict import FAILED, Result

__all__ = ["Progress", "draws_a_bar"]


def draws_a_bar(stream: TextIO) -> bool:
    """Whether a bar goes to ``stream``: only a terminal (a log must not fill with carriage returns)."""
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


class Progress:
    """The ``before`` / ``on_result`` callbacks of :func:`~mlaspec.conformance.runner.run_cases` for ``n`` cases.

    Cases from index ``announced`` on print their reproducer (``repro(case)``) before they run; ``verbose`` adds a
    line per case. ``err`` (default stderr) gets the bar when it is a terminal; ``out`` (default stdout) the lines.
    Use it as a context manager: leaving it takes the bar off the screen.
    """

    FEWEST_BETWEEN_COUNTS = 25
    """A log's count lines are a tenth of the run apart, and at least this many cases (a short run has none)."""

    def __init__(
        self,
        n: int,
        *,
        announced: int,
        repro: Callable[[Case], str],
        verbose: bool = False,
        out: TextIO | None = None,
        err: TextIO | None = None,
    ):
        self.n, self.announced, self.repro, self.verbose = n, announced, repro, verbose
        self.out = sys.stdout if out is None else out
        self.results: list[Result] = []
        self.failed = 0
        self.every = max(self.FEWEST_BETWEEN_COUNTS, math.ceil(n / 10))
        err = sys.stderr if err is None else err
        self.bar = None
        if draws_a_bar(err):
            from tqdm import tqdm

            self.bar = tqdm(total=n, file=err, unit="case", leave=False, dynamic_ncols=True)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.close()

    def write(self, line: str) -> None:
        """``line`` on stdout, flushed (a crash right after must not lose it), below the bar when there is one."""
        if self.bar is None:
            print(line, file=self.out, flush=True)
            return
        self.bar.write(line, file=self.out)
        self.out.flush()

    def _position(self, i: int) -> str:
        return f"[{i + 1:>3}/{self.n}]"

    def before(self, i: int, case: Case) -> None:
        """Case ``i`` is about to run: its id on the bar, its reproducer on stdout when it is announced."""
        if self.bar is not None:
            self.bar.set_description_str(case.id, refresh=True)
        if i >= self.announced:
            self.write(f"{self._position(i)} RUN   {self.repro(case)}")

    def after(self, i: int, result: Result) -> None:
        """Case ``i`` has its verdict: a line when it is worth one, the bar one step on (or a count line)."""
        self.results.append(result)
        self.failed += result.verdict in FAILED
        if self.verbose or i >= self.announced or result.verdict not in ("pass", "skip"):
            self.write(f"{self._position(i)} {result.verdict.upper():<5} {result.case_id}")
        if self.bar is not None:
            self.bar.set_postfix_str(f"{self.failed} failed" if self.failed else "", refresh=False)
            self.bar.update(1)
        elif not self.verbose and (i + 1) % self.every == 0 and i + 1 < self.n:
            self.write(f"{self._position(i)} {verdict_counts(self.results)}")
