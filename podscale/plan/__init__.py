"""podscale.plan: hardware catalog, cost and memory model, layout search and calibration.

    from podscale.plan import predict, search
    p = predict("dgx-a100-80g", 64, "megatron-18b", {"tp": 8, "pp": 1, "dp": 8, "microbatch": 4}, 256)
    p.step_time_s, p.memory_per_device_bytes, p.to_dict()

Formulas and their sources are in the docstrings of ``gpt_cost``, ``memory``, ``network`` and
``compute``; the numbers of each system, with sources, in ``systems/*.toml``.
"""
from .cost import predict
from .hardware import System, load_system, system_names
from .layout import Layout
from .memory import activation_bytes_per_layer, zero_model_state_bytes
from .models import DLRM, GPT, PRESETS, get_model
from .prediction import Prediction
from .search import SearchResult, search

__all__ = ["predict", "search", "Prediction", "SearchResult", "Layout", "GPT", "DLRM", "PRESETS", "get_model",
           "System", "load_system", "system_names", "zero_model_state_bytes", "activation_bytes_per_layer"]
