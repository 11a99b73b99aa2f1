"""Progress display for rank 0: a rich progress bar on a terminal, plain log lines otherwise."""
from __future__ import annotations

import sys

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn, \
    TimeRemainingColumn


class Progress:
    def __init__(self, total: int, start: int = 0, enabled: bool = True):
        self.enabled = enabled
        self.console = Console(file=sys.stdout, highlight=False)
        self.bar = None
        if enabled and self.console.is_terminal:
            self.bar = RichProgress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                    TextColumn("{task.fields[info]}"), TimeRemainingColumn(),
                                    console=self.console)
            self.task = self.bar.add_task("train", total=total, completed=start, info="")
            self.bar.start()

    def print(self, text: str) -> None:
        if self.enabled:
            self.console.print(text, markup=False, soft_wrap=True)

    def update(self, r: dict) -> None:
        if not self.enabled:
            return
        mem = r.get("peak_mem_bytes")
        line = (f"step {r['step']:>5}  loss {r['loss']:.4f}"
                + (f"  val {r['val_loss']:.4f}" if "val_loss" in r else "")
                + f"  {r['tokens_per_s']:,.0f} tok/s  mfu {100 * r['mfu']:.1f}%  comm {100 * r['comm_share']:.0f}%"
                + (f"  mem/rank {','.join(f'{m / 2**20:.0f}' for m in mem)} MiB" if mem else ""))
        if self.bar is not None:
            self.bar.update(self.task, advance=1, info=line.split("  ", 1)[1])
        if mem or "val_loss" in r:
            self.print(line)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
