"""PNG chart of a search: predicted throughput against memory per device, one point per layout."""
from __future__ import annotations


def search_chart(predictions, path: str, title: str = "", highlight: int = 10) -> None:
    import matplotlib
    matplotlib.use("Agg")            # files only; never needs a display
    import matplotlib.pyplot as plt

    from .layout import Layout

    fig, ax = plt.subplots(figsize=(9, 5.5))
    if predictions:
        mem = [p.memory_per_device_bytes / 2**30 for p in predictions]
        tflops = [p.tflops_per_device for p in predictions]
        zero = [p.layout["zero_stage"] for p in predictions]
        sc = ax.scatter(mem, tflops, c=zero, cmap="viridis", s=10, alpha=0.6, vmin=0, vmax=3)
        fig.colorbar(sc, ax=ax, label="ZeRO stage")
        for i, p in enumerate(predictions[:highlight]):
            ax.annotate(f"{i + 1}. {Layout(**p.layout).short()}", (mem[i], tflops[i]), fontsize=6,
                        xytext=(4, -3 - 7 * i), textcoords="offset points")
        ax.axvline(predictions[0].memory_capacity_bytes / 2**30, color="red", lw=0.8, ls="--",
                   label="device memory")
        ax.legend(loc="lower right")
    ax.set_xlabel("memory per device (GiB)")
    ax.set_ylabel("predicted TFLOP/s per device (incl. recompute)")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
