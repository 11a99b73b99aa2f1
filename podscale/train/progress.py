"""Progress display for rank 0: a rich progress bar on a terminal, plain log lines otherwise.  It shows
a metrics record (see :mod:`podscale.train.loop`) of any task: loss, the task's validation metrics
(``val_*``), throughput in the task's unit, MFU, exposed communication and memory."""
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
        evals = [k for k in r if k.startswith("val_")]  # the task's validation metrics, when measured
        line = (f"step {r['step']:>5}  loss {r['loss']:.4f}"
                + "".join(f"  {k.removeprefix('val_') if k != 'val_loss' else 'val'} {r[k]:.4f}" for k in evals)
                + f"  {r['throughput']:,.0f} {r['throughput_unit']}/s  mfu {100 * r['mfu']:.1f}%"
                  f"  comm {100 * r['comm_share']:.0f}%"
                + (f"  mem/rank {','.join(f'{m / 2**20:.0f}' for m in mem)} MiB" if mem else ""))
        if self.bar is not None:
            self.bar.update(self.task, advance=1, info=line.split("  ", 1)[1])
        if mem or evals:
            self.print(line)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
