"""``podscale report RUN_DIR``: PNG plots of a run's loss and throughput from its metrics.jsonl, for any
task: the loss, the task's other validation metrics (``val_*`` keys, e.g. accuracy) and the throughput in
the unit the run logged (``throughput`` and ``throughput_unit``)."""
from __future__ import annotations

from pathlib import Path

from podscale.runtime.metrics import read_metrics


def write_report(run_dir: Path, out: Path | None = None) -> list[Path]:
    """Write ``loss.png``, ``throughput.png`` and, when the task logged validation metrics besides the
    loss, ``metrics.png``; returns their paths."""
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
    return written
