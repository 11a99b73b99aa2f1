"""Where podscale keeps what it measures about a machine (the calibrated ``local`` system, user systems, the
measured matmul peak): ``$PODSCALE_CACHE`` or ``~/.cache/podscale``."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$PODSCALE_CACHE`` or ``~/.cache/podscale``."""
    return Path(os.environ.get("PODSCALE_CACHE", Path.home() / ".cache" / "podscale"))
