"""Malformed configs: one line naming the key and the fix, exit code 2, nothing written."""
import copy
import json
import subprocess
import sys

import pytest
import torch

from podscale.cli import main

GOOD = {
    "run": {"name": "bad", "steps": 5},
    "model": {"n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 64},
    "parallel": {"nproc": 2},
    "train": {"global_batch": 8, "micro_batch": 2},
}

# (what is wrong, (section, key, value) set in the good config, words the message must hold)
CASES = [
    ("unknown key", ("train", "learning_rate", 0.1), ["unknown key 'train.learning_rate'", "lr"]),
    ("unknown section", ("optimizer", "lr", 0.1), ["unknown key 'optimizer'", "train"]),
    ("batch not divisible", ("train", "global_batch", 10), ["train.global_batch=10", "multiple of 4"]),
    ("dp does not fit", ("parallel", "dp", 3), ["pp*dp*ep*tp=3", "parallel.dp=2"]),
    ("missing data", ("data", "path", "/nonexistent/corpus.txt"), ["data.path", "does not exist"]),
    ("heads do not divide", ("model", "n_head", 3), ["n_embd=64", "n_head=3"]),
    ("negative lr", ("train", "lr", -1.0), ["train.lr", "greater than 0"]),
    ("wrong type", ("run", "steps", "many"), ["run.steps", "integer"]),
    ("unknown precision", ("train", "precision", "fp8"), ["train.precision", "fp32", "bf16"]),
    ("min_lr above lr", ("train", "min_lr", 0.5), ["min_lr", "lr"]),
    ("zero processes", ("parallel", "nproc", 0), ["parallel.nproc", "greater than or equal to 1"]),
    ("bad run name", ("run", "name", "a/b"), ["run.name"]),
    ("dropout out of range", ("model", "dropout", 1.5), ["model.dropout"]),
    ("unknown zero stage", ("zero", "stage", 4), ["zero.stage"]),
    ("unknown device", ("run", "device", "tpu"), ["run.device", "cuda"]),
    ("infinite float", ("train", "grad_clip", float("inf")), ["train.grad_clip", "finite number"]),
]
if not torch.cuda.is_available():
    CASES.append(("cuda without a gpu", ("run", "device", "cuda"), ["run.device='cuda'", "run.device = 'cpu'"]))
elif torch.cuda.device_count() < GOOD["parallel"]["nproc"]:  # NCCL cannot put two ranks on one GPU
    CASES.append(("more ranks than gpus", ("run", "device", "cuda"), ["GPU(s) visible", "run.device = 'cpu'"]))


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value == float("inf"):
        return "inf"  # JSON has no spelling for it
    return json.dumps(value)  # numbers and simple strings are spelled the same in JSON and TOML


def _write(tmp_path, change=None, raw=None):
    data = copy.deepcopy(GOOD)
    data["run"]["out_dir"] = str(tmp_path / "runs")
    if change is not None:
        section, key, value = change
        data.setdefault(section, {})[key] = value
    text = raw if raw is not None else "".join(
        f"[{section}]\n" + "".join(f"{k} = {_toml(v)}\n" for k, v in keys.items())
        for section, keys in data.items())
    path = tmp_path / "cfg.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("what,change,words", CASES, ids=[c[0] for c in CASES])
def test_malformed_config_fails_with_one_line(tmp_path, capsys, what, change, words):
    cfg = _write(tmp_path, change)
    assert main(["train", str(cfg)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    assert err.startswith("podscale: error: ")
    for w in words:
        assert w in err, (w, err)
    assert not (tmp_path / "runs").exists()


def test_toml_syntax_error_and_missing_file(tmp_path, capsys):
    cfg = _write(tmp_path, raw="[run\nname = 1")
    assert main(["train", str(cfg)]) == 2
    assert "not valid TOML" in capsys.readouterr().err
    assert main(["train", str(tmp_path / "nope.toml")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["train", "--set", "steps=3"]) == 2
    assert "section.key" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_exit_code_from_the_command_line(tmp_path):
    cfg = _write(tmp_path, ("train", "global_batch", "10"))
    out = subprocess.run([sys.executable, "-m", "podscale", "train", str(cfg)], capture_output=True, text=True)
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and "global_batch" in out.stderr
    assert not (tmp_path / "runs").exists()


# Holes found by a new user (issue 11, item 5): each is one line before workers start, exit 2.
HOLES = [
    ("param on nvme without nvme optimizer",
     {"zero": {"stage": 3, "offload_param": "nvme", "nvme_path": "{tmp}"}},
     ["zero.offload_param='nvme' needs zero.offload_optimizer='nvme'"]),
    ("param on nvme, optimizer on cpu",
     {"zero": {"stage": 3, "offload_param": "nvme", "offload_optimizer": "cpu", "nvme_path": "{tmp}"}},
     ["offload_optimizer='nvme'", "got offload_optimizer='cpu'"]),
    ("param on cpu with nvme optimizer",
     {"zero": {"stage": 3, "offload_param": "cpu", "offload_optimizer": "nvme", "nvme_path": "{tmp}"}},
     ["zero.offload_param='cpu' with zero.offload_optimizer='nvme'", "offload_param='nvme'"]),
    ("vocabulary smaller than the bytes", {"model": {"vocab_size": 100}},
     ["model.vocab_size=100", "256"]),
    ("unknown load-balancing loss scope", {"model": {"kind": "gpt-moe", "aux_loss_scope": "batch"}},
     ["model.aux_loss_scope", "'group', 'global' or 'global_step'", "'batch'"]),
    ("vocabulary smaller than the bytes, with a corpus file", {"model": {"vocab_size": 255}, "data": {"path": "{corpus}"}},
     ["model.vocab_size=255", "256"]),
]


@pytest.mark.parametrize("what,changes,words", HOLES, ids=[h[0] for h in HOLES])
def test_config_holes_fail_before_workers_start(tmp_path, capsys, what, changes, words):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("to be or not to be " * 500)
    data = copy.deepcopy(GOOD)
    data["run"]["out_dir"] = str(tmp_path / "runs")
    for section, keys in changes.items():
        for k, v in keys.items():
            data.setdefault(section, {})[k] = v.format(tmp=tmp_path, corpus=corpus) if isinstance(v, str) else v
    cfg = tmp_path / "cfg.toml"
    cfg.write_text("".join(f"[{section}]\n" + "".join(f"{k} = {_toml(v)}\n" for k, v in keys.items())
                           for section, keys in data.items()))
    assert main(["train", str(cfg)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("podscale: error: ") and "\n" not in err, err
    for w in words:
        assert w in err, (w, err)
    assert not (tmp_path / "runs").exists()


def test_supported_offload_combinations_still_validate(tmp_path):
    from podscale.config import parse_config
    for opt, param in (("nvme", "nvme"), ("cpu", "cpu"), ("none", "cpu"), ("nvme", "none"), ("cpu", "none")):
        parse_config({"zero": {"stage": 3, "offload_optimizer": opt, "offload_param": param,
                               "nvme_path": str(tmp_path)}})
    parse_config({"model": {"vocab_size": 256}})
