"""Loading a checkpoint never unpickles (issue 11, item 2): DCP's `.metadata` is read through an allow-list."""
import json
import pickle
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from podscale.cli import main
from podscale.train import checkpoint
from podscale.train.safe_reader import SafeFileSystemReader, UnsafeCheckpointError


def _write_checkpoint(folder, step=3):
    tensors = {"model": {"w": torch.randn(4, 3), "b": torch.arange(5, dtype=torch.bfloat16)},
               "optim": {"w.exp_avg": torch.zeros(4, 3, dtype=torch.float64), "step": torch.tensor(7)}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(tensors, checkpoint_id=str(folder))
    (folder / "meta.json").write_text(json.dumps({"step": step, "model_config": {"n_layer": 1}}))
    return tensors


class _Payload:
    """Unpickling this creates ``path`` (any callable would do: os.system, exec, ...)."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return open, (str(self.path), "w")


def _plant(folder, obj):
    (folder / ".metadata").write_bytes(pickle.dumps(obj))


def test_a_podscale_checkpoint_still_loads_and_exports(tmp_path):
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000003"
    saved = _write_checkpoint(ckpt)
    template = {"model": {"w": torch.empty(4, 3), "b": torch.empty(5, dtype=torch.bfloat16)},
                "optim": {"w.exp_avg": torch.empty(4, 3, dtype=torch.float64), "step": torch.tensor(0)}}
    meta, rank_state = checkpoint.load(ckpt, template, rank=0)
    assert meta["step"] == 3 and rank_state is None
    for part in saved:
        for k, v in saved[part].items():
            assert torch.equal(template[part][k], v), k
    out = checkpoint.export(ckpt, tmp_path / "model.pt")
    blob = torch.load(out, weights_only=True)
    assert torch.equal(blob["model"]["w"], saved["model"]["w"]) and blob["step"] == 3


def test_export_reads_the_weights_without_torch_warning_of_a_missing_process_group(tmp_path):
    """``podscale export`` (and ``train.init_from``) read the weights in one process on purpose: DCP's
    "torch.distributed is disabled, ... assuming the intent is to load in a single process" is not the
    user's business."""
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000003"
    _write_checkpoint(ckpt)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        checkpoint.export(ckpt, tmp_path / "model.pt")


@pytest.mark.parametrize("what", ["code", "torch.load", "bytes entry", "not metadata", "truncated", "path"])
def test_crafted_metadata_is_refused_and_runs_nothing(tmp_path, capsys, what):
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000003"
    _write_checkpoint(ckpt)
    canary = tmp_path / "pwned"
    real = pickle.loads((ckpt / ".metadata").read_bytes())
    if what == "code":
        _plant(ckpt, _Payload(canary))
    elif what == "torch.load":  # a torch function, not a dtype: refused by name
        (ckpt / ".metadata").write_bytes(b"\x80\x04ctorch\nload\n)R.")
    elif what == "bytes entry":  # DCP would torch.load(weights_only=False) this entry
        real.state_dict_metadata["model.w"] = BytesStorageMetadata()
        _plant(ckpt, real)
    elif what == "not metadata":
        _plant(ckpt, {"hello": [1, 2]})
    elif what == "truncated":
        data = pickle.dumps(real)
        (ckpt / ".metadata").write_bytes(data[: len(data) // 2])
    elif what == "path":  # an entry read from a file outside the checkpoint
        index = next(iter(real.storage_data))
        real.storage_data[index].relative_path = "../../../etc/passwd"
        _plant(ckpt, real)
    meta_file = str(ckpt / ".metadata")

    with pytest.raises(UnsafeCheckpointError) as err:
        SafeFileSystemReader(str(ckpt)).read_metadata()
    msg = str(err.value)
    assert "\n" not in msg and meta_file in msg and ("write a new one" in msg or "earlier one" in msg), msg
    with pytest.raises(UnsafeCheckpointError):
        checkpoint.load(ckpt, {"model": {"w": torch.empty(4, 3)}}, rank=0)

    # `podscale export`: one line naming the file, exit 2, nothing written
    out = tmp_path / "exported" / "model.pt"
    assert main(["export", str(tmp_path / "run"), str(out)]) == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith("podscale: error: ") and "\n" not in line and meta_file in line, line
    assert not (tmp_path / "exported").exists()
    assert not canary.exists()


def test_resume_refuses_a_crafted_checkpoint_before_workers_start(tmp_path, monkeypatch, capsys):
    ckpt = tmp_path / "runs" / "r" / "checkpoints" / "step_00000003"
    _write_checkpoint(ckpt)
    canary = tmp_path / "pwned"
    _plant(ckpt, _Payload(canary))
    monkeypatch.chdir(tmp_path)
    before = sorted(p.name for p in (tmp_path / "runs" / "r").rglob("*"))
    assert main(["train", "--name", "r", "--nproc", "1", "--steps", "5", "--resume"]) == 2
    line = capsys.readouterr().err.strip()
    assert "\n" not in line and "step_00000003/.metadata" in line, line
    assert sorted(p.name for p in (tmp_path / "runs" / "r").rglob("*")) == before
    assert not canary.exists()


def test_the_stock_reader_would_have_run_the_payload(tmp_path):
    # the test's payload is real: DCP's own reader unpickles it and creates the file
    ckpt = tmp_path / "step_00000001"
    _write_checkpoint(ckpt)
    canary = tmp_path / "pwned"
    _plant(ckpt, _Payload(canary))
    from torch.distributed.checkpoint import FileSystemReader
    try:
        FileSystemReader(str(ckpt)).read_metadata()
    except Exception:
        pass
    assert canary.exists()
