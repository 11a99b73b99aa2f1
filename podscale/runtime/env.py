"""Facts about how this process was started, without importing torch."""
import os


def under_launcher() -> bool:
    """True when this process was started by torchrun or podscale's elastic agent."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))
