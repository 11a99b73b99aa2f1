"""podscale: train models too big for one device, and predict how they will run on a pod.

The Python API mirrors what people already use::

    import podscale
    cfg = podscale.load_config("examples/gpt-small.toml")
    mesh = podscale.init(cfg)                      # joins torchrun's process group, builds the mesh
    engine = podscale.parallelize(model, mesh, cfg)  # applies the layout; returns an Engine
    result = engine.step(micro_batches)
"""
from __future__ import annotations

from podscale.config import Config, ConfigError, load_config

__version__ = "0.1.0"
__all__ = ["Config", "ConfigError", "load_config", "init", "parallelize", "__version__"]


def init(cfg: Config | None = None, **sizes: int):
    """Initialise torch.distributed from the launcher's environment and build the mesh.

    Axis sizes come from ``cfg`` (its ``parallel`` section) or from keyword arguments (``dp=2, tp=1``);
    missing axes are 1, and ``dp`` defaults to what the others leave of the world.
    """
    from podscale.runtime.mesh import Mesh
    from podscale.runtime.process import DEFAULT_TIMEOUT_S, init_process
    from podscale.runtime.watchdog import backstop_s

    # with a config: torch's process-group timeout from run.collective_timeout_s, as under `podscale train`
    # (the hang watchdog itself is podscale.runtime.watchdog.start(mesh, cfg.run.collective_timeout_s))
    timeout_s = backstop_s(cfg.run.collective_timeout_s) if cfg is not None else DEFAULT_TIMEOUT_S
    info = init_process(timeout_s=timeout_s, device=cfg.run.device if cfg is not None else "auto")
    if cfg is not None:
        cfg.check_layout(info.world_size)
        sizes = cfg.mesh_sizes()
    elif "dp" not in sizes:
        inner = 1
        for a in ("pp", "ep", "tp"):
            inner *= sizes.get(a, 1)
        sizes = dict(sizes, dp=max(1, info.world_size // inner))
    return Mesh.build(info.device, timeout_s=timeout_s, **sizes)


def parallelize(model, mesh, cfg: Config, task=None):
    """Apply ``cfg``'s layout to a plain ``model`` on ``mesh`` and return a training :class:`Engine`:
    pipeline stages on ``pp``, tensor/sequence parallelism on ``tp``, then the data-parallel strategy on
    ``dp`` (replicated, or ZeRO when ``zero.stage`` > 0); see :mod:`podscale.parallel.compose`.  The
    engine trains with ``task``'s loss (a :class:`podscale.tasks.Task`; default: the one ``cfg``'s
    ``[model]`` names, the GPT unless ``kind`` says otherwise), so ``engine.step`` takes that task's
    batches."""
    from podscale.parallel.compose import build_engine

    return build_engine(model, mesh, cfg, task)
