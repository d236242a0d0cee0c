"""Progress for every long command (eval, export, quantize, reason, sweep, bench-serve), with rich as `prepare`.

    progress = Progress(show=args.progress)
    with progress.stage("phonebook 20 entries", total=40, unit="samples") as bar:
        for batch in batches:
            ...
            bar.advance(len(batch))

On a terminal each stage is a rich bar (done / total, elapsed, time left). When the stream is not a terminal (a
log file, a pipe, CI) a stage is one plain line when it starts, so logs stay readable; with `show=False`
(`--progress false`) nothing is printed. Progress goes to stderr: stdout stays the command's result.
"""

from __future__ import annotations

import argparse
import sys
from contextlib import contextmanager
from typing import IO, Iterator


def parse_bool(text: str) -> bool:
    """argparse type of `--progress true|false` (the spelling `pretrain --progress` takes too)."""
    low = str(text).strip().lower()
    if low in ("true", "1", "yes", "on"):
        return True
    if low in ("false", "0", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def add_progress_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--progress", type=parse_bool, default=True, metavar="true|false",
                        help="progress bars on a terminal, one line per stage otherwise (default true); false: "
                             "quiet")


class _Quiet:
    """What a stage yields when no bar is drawn: the same calls, doing nothing."""

    def advance(self, n: float = 1) -> None:
        pass

    def update(self, completed: float | None = None, total: float | None = None, note: str | None = None) -> None:
        pass


class _Bar:
    def __init__(self, bar, task):
        self._bar, self._task = bar, task

    def advance(self, n: float = 1) -> None:
        self._bar.advance(self._task, n)

    def update(self, completed: float | None = None, total: float | None = None, note: str | None = None) -> None:
        fields = {} if note is None else {"note": note}
        self._bar.update(self._task, completed=completed, total=total, **fields)


@contextmanager
def no_stage(label: str = "", total: float | None = None, unit: str = "") -> Iterator[_Quiet]:
    """A stage that shows nothing (the default of functions that take a `stage`)."""
    yield _Quiet()


class Progress:
    """Stages of one command. `show`: the --progress flag; `stream`: stderr unless given (tests pass their own)."""

    def __init__(self, show: bool = True, stream: IO[str] | None = None):
        self.stream = stream if stream is not None else sys.stderr
        self.show = bool(show)
        isatty = getattr(self.stream, "isatty", None)
        self.live = self.show and bool(isatty and isatty())

    def line(self, text: str) -> None:
        """A line that is shown whatever the stream (plans, stage summaries), unless quiet."""
        if self.show:
            print(text, file=self.stream, flush=True)

    @contextmanager
    def stage(self, label: str, total: float | None = None, unit: str = "",
              log: bool = True) -> Iterator[_Bar | _Quiet]:
        """A bar on a terminal; otherwise a line (`log=False`: none, for a stage that checks input, such as
        loading a checkpoint, so a refusal stays the one line of the error)."""
        if not self.show or (not self.live and not log):
            yield _Quiet()
            return
        if not self.live:
            size = "" if total is None else f": {total:,.0f}" + (f" {unit}" if unit else "")
            self.line(f"{label}{size} ...")
            yield _Quiet()
            return
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn
        from rich.progress import TimeElapsedColumn, TimeRemainingColumn

        bar = RichProgress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                           TextColumn(unit), TextColumn("{task.fields[note]}"), TimeElapsedColumn(),
                           TextColumn("left"), TimeRemainingColumn(),
                           console=Console(file=self.stream, force_terminal=True), transient=False)
        task = bar.add_task(label, total=total, note="")
        bar.start()
        try:
            yield _Bar(bar, task)
        finally:
            bar.stop()
