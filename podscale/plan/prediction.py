"""The result of predicting one layout: step time with its breakdown, memory, throughput."""
from __future__ import annotations

from dataclasses import dataclass, field

SECONDS_PER_DAY = 86400.0


@dataclass
class Prediction:
    system: str
    devices: int
    batch: int
    model: str
    layout: dict
    step_time_s: float
    time_breakdown_s: dict          # parts sum to step_time_s
    memory_per_device_bytes: float
    memory_breakdown_bytes: dict
    memory_capacity_bytes: float
    host_memory_per_device_bytes: float
    hardware_flops_per_step: float  # including recomputation (what Megatron's Table 1 counts)
    model_flops_per_step: float     # without recomputation (PaLM's MFU definition)
    tokens_per_step: float          # samples per step for DLRM
    peak_flops_per_device: float
    notes: list = field(default_factory=list)
    validated: bool = False         # the system was checked against a published result
    components_s: dict = field(default_factory=dict)   # the step by kind of work (GPT only); sums to step_time_s

    @property
    def fits(self) -> bool:
        return self.memory_per_device_bytes <= self.memory_capacity_bytes

    @property
    def tflops_per_device(self) -> float:
        """Achieved TFLOP/s per device counting recompute FLOPs, as Narayanan et al. 2021 report."""
        return self.hardware_flops_per_step / (self.step_time_s * self.devices) / 1e12

    @property
    def mfu(self) -> float:
        """Model FLOP/s utilisation: model FLOPs (no recompute) / (time * devices * peak)
        (Chowdhery et al., PaLM, 2022, App. B)."""
        return self.model_flops_per_step / (self.step_time_s * self.devices * self.peak_flops_per_device)

    @property
    def hfu(self) -> float:
        return self.hardware_flops_per_step / (self.step_time_s * self.devices * self.peak_flops_per_device)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_time_s

    def days_to_train(self, tokens: float) -> float:
        return tokens / self.tokens_per_s / SECONDS_PER_DAY

    def to_dict(self, train_tokens: float = 300e9) -> dict:
        return {
            "system": self.system, "devices": self.devices, "batch": self.batch, "model": self.model,
            "layout": self.layout,
            "step_time_s": self.step_time_s,
            "time_breakdown_s": self.time_breakdown_s,
            "tflops_per_device": self.tflops_per_device,
            "mfu": self.mfu, "hfu": self.hfu,
            "tokens_per_s": self.tokens_per_s,
            "train_tokens": train_tokens,
            "days_to_train": self.days_to_train(train_tokens),
            "memory_per_device_bytes": self.memory_per_device_bytes,
            "memory_breakdown_bytes": self.memory_breakdown_bytes,
            "memory_capacity_bytes": self.memory_capacity_bytes,
            "host_memory_per_device_bytes": self.host_memory_per_device_bytes,
            "fits": self.fits,
            "hardware_flops_per_step": self.hardware_flops_per_step,
            "model_flops_per_step": self.model_flops_per_step,
            "validated": self.validated,
            "notes": self.notes,
        }
