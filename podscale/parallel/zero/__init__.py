"""ZeRO: sharded optimizer state (stage 1), gradients (2) and parameters (3), with offload to CPU memory
and NVMe (Rajbhandari et al. 2020; Ren et al. 2021; Rajbhandari et al. 2021)."""
from podscale.parallel.model_protocols import MetaInitModel
from podscale.parallel.zero.strategy import ZeroStrategy

__all__ = ["ZeroStrategy", "build_strategy"]


def build_strategy(model, mesh, train, zero, bucket_mb: float = 25.0, param_init=None, ep_sharded=()):
    """The Engine strategy for ``zero.stage``: None (the engine's replicated DataParallel) for stage 0,
    else a :class:`ZeroStrategy` over the model moved to the mesh's device.  ``zero`` is a validated
    :class:`~podscale.config.ZeroSection` (its validators hold ZeRO's rules).  A model built on the meta
    device is materialised one unit at a time by ``param_init`` (default: its own
    :meth:`~podscale.parallel.model_protocols.MetaInitModel.init_parameter`)."""
    if zero.stage == 0:
        return None
    if not any(p.is_meta for p in model.parameters()):
        model = model.to(mesh.device)
    elif param_init is None and isinstance(model, MetaInitModel):  # it knows its own initialisation
        param_init = model.init_parameter
    return ZeroStrategy(model, mesh, train, zero, param_init=param_init, ep_sharded=ep_sharded)
