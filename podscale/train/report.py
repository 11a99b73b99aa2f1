"""``podscale report RUN_DIR``: PNG plots of a run's loss and throughput from its metrics.jsonl, for any
task: the loss, the task's other validation metrics (``val_*`` keys, e.g. accuracy) and the throughput in
the unit the run logged (``throughput`` and ``throughput_unit``), and the task's own per-step series (the
record's ``"task"`` entries, ``"<series>/<name>"``: one panel per name, one line per series; e.g. a
mixture-of-experts model's per-layer expert load and dropped share)."""
from __future__ import annotations

from pathlib import Path

from podscale.runtime.metrics import read_metrics


def write_report(run_dir: Path, out: Path | None = None) -> list[Path]:
    """Write ``loss.png``, ``throughput.png``, ``metrics.png`` when the task logged validation metrics
    besides the loss, and ``task.png`` when it logged per-step series; returns their paths."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"no metrics.jsonl in '{run_dir}': give the directory of a podscale train run")
    try:
        rows = read_metrics(path)
    except ValueError as err:
        raise ValueError(f"'{path}' is not a podscale metrics file ({err}): give the directory of a podscale "
                         "train run") from None
    if not rows:
        raise ValueError(f"'{path}' holds no steps yet: train for at least one step first")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out or run_dir)
    out.mkdir(parents=True, exist_ok=True)
    steps = [r["step"] for r in rows]

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [r["loss"] for r in rows], label="train loss", lw=1)
    val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(f"{Path(run_dir).name}: loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    loss_png = out / "loss.png"
    fig.savefig(loss_png, dpi=110)
    plt.close(fig)

    fig, ax1 = plt.subplots(figsize=(7, 4))
    # (runs logged before tasks existed were GPT runs with only "tokens_per_s")
    ax1.plot(steps, [r["throughput"] if "throughput" in r else r["tokens_per_s"] for r in rows],
             color="tab:blue", lw=1)
    ax1.set_xlabel("step")
    ax1.set_ylabel(f"{rows[-1].get('throughput_unit', 'tokens')}/s", color="tab:blue")
    ax2 = ax1.twinx()
    ax2.plot(steps, [100 * r["mfu"] for r in rows], color="tab:orange", lw=1)
    ax2.plot(steps, [100 * r["comm_share"] for r in rows], color="tab:green", lw=1, ls="--")
    ax2.set_ylabel("% (orange: MFU, green: exposed communication)")
    ax1.set_title(f"{Path(run_dir).name}: throughput")
    ax1.grid(alpha=0.3)
    fig.tight_layout()
    tput_png = out / "throughput.png"
    fig.savefig(tput_png, dpi=110)
    plt.close(fig)
    written = [loss_png, tput_png]

    metrics = sorted({k for r in rows for k in r if k.startswith("val_") and k != "val_loss"})
    if metrics:
        fig, ax = plt.subplots(figsize=(7, 4))
        for k in metrics:
            ax.plot(*zip(*[(r["step"], r[k]) for r in rows if k in r]), "o-", label=k.removeprefix("val_"))
        ax.set_xlabel("step")
        ax.set_title(f"{Path(run_dir).name}: validation metrics")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        metrics_png = out / "metrics.png"
        fig.savefig(metrics_png, dpi=110)
        plt.close(fig)
        written.append(metrics_png)

    task_png = _task_series(rows, out, Path(run_dir).name, plt)
    if task_png is not None:
        written.append(task_png)
    return written


def _task_series(rows: list[dict], out: Path, title: str, plt) -> Path | None:
    """``task.png``: every name of the rows' ``"task"`` entries over the steps, one panel per name and one
    line per series (the part before the last '/'); None when the task logged none."""
    series: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for r in rows:
        for key, value in (r.get("task") or {}).items():
            who, _, name = key.rpartition("/")
            series.setdefault(name, {}).setdefault(who or name, []).append((r["step"], value))
    if not series:
        return None
    names = sorted(series)
    cols = min(3, len(names))
    nrows = -(-len(names) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.5 * cols, 3.2 * nrows), squeeze=False)
    for ax, name in zip(axes.flat, names):
        for who, points in sorted(series[name].items()):
            ax.plot(*zip(*points), lw=1, label=who)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if len(series[name]) > 1:
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(names):]:
        ax.set_visible(False)
    fig.suptitle(f"{title}: per-step task metrics")
    fig.tight_layout()
    path = out / "task.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
