"""Rich progress bar for gate runs (the orchestrator only sees start / describe / advance / stop)."""
from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


class RichProgress:
    def __init__(self, console: Console):
        self.progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), TimeRemainingColumn(), console=console, transient=False)
        self.task = None

    def start(self, total: int, done: int) -> None:
        self.progress.start()
        self.task = self.progress.add_task("starting", total=total, completed=done)

    def describe(self, text: str) -> None:
        if self.task is not None:
            self.progress.update(self.task, description=text)

    def advance(self, n: int) -> None:
        if self.task is not None:
            self.progress.advance(self.task, n)

    def stop(self) -> None:
        if self.task is not None:
            self.progress.update(self.task, description="done")
        self.progress.stop()
