"""``predict``: one layout of one model on one system -> Prediction (memory, step time, throughput)."""
from __future__ import annotations

from .dlrm_cost import predict_dlrm
from .gpt_cost import predict_gpt
from .hardware import System, as_system
from .layout import Layout, layout_from_dict
from .models import DLRM, GPT, as_model
from .prediction import Prediction


def predict(system: System | str, devices: int, model, layout: Layout | dict, batch: int) -> Prediction:
    """Predict one layout. ``system`` is a System or a catalog name, ``model`` a GPT/DLRM, a preset
    name or a dict, ``layout`` a Layout or a dict in the trainer's vocabulary."""
    system, model = as_system(system), as_model(model)
    if isinstance(layout, dict):
        layout = layout_from_dict(layout)
    system.check_devices(devices)
    if batch < 1:
        raise ValueError(f"--batch must be >= 1, got {batch}")
    if isinstance(model, DLRM):
        pred = predict_dlrm(system, devices, model, layout, batch)
    elif isinstance(model, GPT):
        pred = predict_gpt(system, devices, model, layout, batch)
    else:
        raise TypeError(f"cannot predict a {type(model).__name__}")
    if not system.validated and system.topology != "host":
        pred.notes.append(f"system {system.name} is not validated against a published training result: "
                          "its predictions are estimates (see `podscale plan validate`)")
    pred.validated = bool(system.validated)
    return pred
