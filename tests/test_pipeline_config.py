"""Bad tensor/sequence/pipeline layouts fail before any worker starts, with one line naming the fix; stage
partitioning balances the blocks."""
import pytest

from podscale.cli import main
from podscale.config import ConfigError, parse_config
from podscale.models.gpt import GPT, GPTConfig
from podscale.parallel.pipeline.partition import PipelineError, contiguous_partition, stage_layers
from podscale.parallel.pipeline.schedule import check_schedule
from podscale.parallel.tensor import padded_vocab


def _check(nproc=4, parallel=None, model=None, train=None, **sections):
    d = {"parallel": {"nproc": nproc, **(parallel or {})}, "model": model or {},
         "train": train or {"global_batch": 16, "micro_batch": 2}, **sections}
    cfg = parse_config(d)
    cfg.check_layout(nproc)
    return cfg


@pytest.mark.parametrize("kw, fragment", [
    (dict(nproc=3, parallel={"tp": 3}), "model.n_head=4 is not divisible by parallel.tp=3"),
    (dict(parallel={"tp": 4}, model={"n_head": 6, "n_embd": 96}), "multiple of 4 or a smaller tp"),
    (dict(parallel={"tp": 4, "sequence_parallel": True}, model={"block_size": 66}),
     "set parallel.sequence_parallel = false"),
    (dict(parallel={"pp": 4}, model={"n_layer": 3}), "model.n_layer=3 is fewer than the 4 pipeline stages"),
    (dict(parallel={"pp": 2, "schedule": "interleaved", "virtual_stages": 4}, model={"n_layer": 6}),
     "use at least 8 layers"),
    (dict(parallel={"pp": 4, "schedule": "interleaved", "virtual_stages": 2}, model={"n_layer": 8},
          train={"global_batch": 6, "micro_batch": 1}), "multiple of parallel.pp=4"),
    (dict(parallel={"pp": 2, "virtual_stages": 2}), "needs parallel.schedule = 'interleaved'"),
    (dict(parallel={"pp": 2, "schedule": "interleaved"}), "virtual_stages >= 2"),
    (dict(parallel={"pp": 2, "pipeline_layers": [1, 2]}), "sum to model.n_layer=4"),
    (dict(parallel={"pp": 2}, zero={"stage": 2, "reshard_after_forward": False}), "needs zero.stage=3"),
])
def test_bad_layouts_name_the_fix(kw, fragment):
    with pytest.raises(ConfigError, match=None) as err:
        _check(**kw)
    msg = str(err.value)
    assert fragment in msg and "\n" not in msg, msg


def test_good_layouts_pass():
    _check(parallel={"pp": 2, "tp": 2, "sequence_parallel": True})
    _check(nproc=8, parallel={"pp": 2, "tp": 2}, zero={"stage": 1})
    _check(parallel={"pp": 2, "schedule": "interleaved", "virtual_stages": 2})
    _check(parallel={"pp": 2, "pipeline_layers": [1, 3]})
    # ZeRO-2/3 compose with pipelines and with sequence parallelism (tests/test_pipeline_3d.py trains them)
    for stage in (2, 3):
        _check(parallel={"pp": 2, "schedule": "interleaved", "virtual_stages": 2}, zero={"stage": stage})
        _check(parallel={"tp": 2, "sequence_parallel": True}, zero={"stage": stage})
        _check(nproc=8, parallel={"pp": 2, "tp": 2, "sequence_parallel": True}, zero={"stage": stage})
    _check(parallel={"pp": 2}, zero={"stage": 3, "reshard_after_forward": False})
    _check(parallel={"pp": 2}, run={"eval_every": 10, "sample_tokens": 16})  # forward-only pipeline
    _check(parallel={"tp": 2}, run={"sample_tokens": 16})  # vocab shards gathered for sampling
    _check(parallel={"tp": 2}, model={"dropout": 0.1})  # the model-parallel RNG tracker


def test_cli_rejects_before_workers(tmp_path, capsys):
    """``podscale train`` through its entry point in this process: exit code 2 and the fix named before any
    worker starts or any file is written (test_config_errors.py runs a refused command as a subprocess)."""
    code = main(["train", "--nproc", "3", "--set", "parallel.tp=3", "--set", f"run.out_dir={tmp_path}"])
    out = capsys.readouterr()
    assert code == 2
    assert "parallel.tp=3" in out.err + out.out
    assert not any(tmp_path.iterdir())


def test_vocab_padding_and_schedule_checks():
    assert padded_vocab(258, 4) == 260 and padded_vocab(256, 4) == 256
    with pytest.raises(PipelineError, match="multiple of parallel.pp=4"):
        check_schedule("interleaved", 4, 6, 2)
    with pytest.raises(PipelineError, match="unknown pipeline schedule"):
        check_schedule("zigzag", 2, 4)


def test_stage_partition():
    assert contiguous_partition([1.0] * 8, 4) == [2, 2, 2, 2]
    assert contiguous_partition([5, 1, 1, 1, 1, 1], 2) == [1, 5]
    model = GPT(GPTConfig(n_layer=6, n_embd=32, n_head=4, vocab_size=2048))
    # by parameters: the first and last chunk also hold the (large) embedding and output layer
    by_params = stage_layers(model, 3, "params")
    assert [len(g) for g in by_params] == [1, 4, 1]
    assert stage_layers(model, 3, layers=[2, 2, 2]) == [[0, 1], [2, 3], [4, 5]]
    timed = stage_layers(model, 2, "time")
    assert sum(len(g) for g in timed) == 6 and all(timed)
    with pytest.raises(PipelineError, match="fewer than the 8 pipeline stages"):
        stage_layers(model, 8)
