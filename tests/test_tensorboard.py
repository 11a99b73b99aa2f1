"""TensorBoard event files beside metrics.jsonl: every number of a record readable by tensorboard's own
event reader at its step (nested per-axis communication, per-rank memory), and a resumed run's log
replacing what the interrupted run wrote after its checkpoint."""
import json

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from podscale.config import ConfigError, parse_config
from podscale.runtime.metrics import MetricsLog, scalars


def _record(step: int, loss: float) -> dict:
    return {"step": step, "loss": loss, "skipped": False, "tokens_per_s": 1000.0 + step,
            "comm": {"dp": {"bytes": 4096.0 * step, "exposed_s": 0.01}},
            "peak_mem_bytes": [1e6 * step, 2e6 * step], "note": "text is left out"}


def _read(folder) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_scalars_flatten_a_record():
    assert scalars(_record(3, 2.5)) == {
        "loss": 2.5, "skipped": 0.0, "tokens_per_s": 1003.0, "comm/dp/bytes": 4096.0 * 3,
        "comm/dp/exposed_s": 0.01, "peak_mem_bytes/rank0": 3e6, "peak_mem_bytes/rank1": 6e6}


def test_metrics_go_to_tensorboard_and_jsonl(tmp_path):
    log = MetricsLog(tmp_path / "metrics.jsonl", tensorboard=True)
    for s in range(1, 5):
        log.write(_record(s, 5.0 - s))
    log.close()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    tb = _read(tmp_path / "tensorboard")
    assert tb["loss"] == [(s, pytest.approx(5.0 - s)) for s in range(1, 5)]
    assert tb["comm/dp/bytes"][-1] == (4, pytest.approx(4096.0 * 4))
    assert tb["peak_mem_bytes/rank1"][1] == (2, pytest.approx(4e6))

    # resume from a checkpoint at step 2: the steps after it are written again, and TensorBoard shows the
    # resumed values only
    log = MetricsLog(tmp_path / "metrics.jsonl", truncate_from_step=2, tensorboard=True)
    for s in (3, 4):
        log.write(_record(s, 10.0 + s))
    log.close()
    assert [json.loads(x)["loss"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [4, 3, 13, 14]
    assert _read(tmp_path / "tensorboard")["loss"] == [(1, 4.0), (2, 3.0), (3, 13.0), (4, 14.0)]


def test_tensorboard_without_the_package_is_a_config_error(monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(ConfigError, match="pip install tensorboard"):
        parse_config({"run": {"tensorboard": True}})
