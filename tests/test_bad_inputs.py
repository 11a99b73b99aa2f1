"""The bad-input corpus (issue 11, item 10): every case is one line naming what is wrong and the fix,
exit code 2, and nothing written.  All cases run in-process (no worker starts).

To add a case, append ``(id, argv, words)`` to CASES: ``{tmp}`` in argv is the test's folder (also the
working directory, so default run directories would land there), ``{ckpt}`` a run directory whose
checkpoint SETUP has damaged, ``{data}`` a folder of bad data files; ``words`` must all be in the message.
"""
import json
import os
import pickle
import shlex
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from podscale.cli import main

M = '{"layers":24,"hidden":2304,"heads":24,"seq":2048,"vocab":51200}'
L = '{"tp":1,"pp":1,"dp":32,"microbatch":16}'
PREDICT = "plan predict --system dgx-a100-80g --devices 32 --batch 512"
SEARCH = "plan --model gpt-175b --system dgx-a100-superpod --batch 1536"
TRAIN = "train --nproc 1 --set run.steps=1"  # (the cases' own --set come after, and win)


def _set(*items: str) -> str:
    return TRAIN + "".join(f" --set {shlex.quote(i)}" for i in items)


CASES = [
    # config keys (the bundled default config, changed with --set)
    ("unknown key", _set("train.learning_rate=0.1"), ["unknown key 'train.learning_rate'", "lr"]),
    ("unknown section", _set("optimizer.lr=0.1"), ["unknown key 'optimizer'"]),
    ("wrong type", _set("run.steps='many'"), ["run.steps", "integer"]),
    ("negative lr", _set("train.lr=-1.0"), ["train.lr", "greater than 0"]),
    ("unknown precision", _set("train.precision='fp8'"), ["train.precision", "bf16"]),
    ("unknown zero stage", _set("zero.stage=4"), ["zero.stage"]),
    ("min_lr above lr", _set("train.min_lr=0.5"), ["min_lr", "lr"]),
    ("dropout out of range", _set("model.dropout=1.5"), ["model.dropout"]),
    ("heads do not divide", _set("model.n_head=3"), ["n_embd=128", "n_head=3"]),
    ("block size 1", _set("model.block_size=1"), ["model.block_size"]),
    ("keep no checkpoints", _set("checkpoint.keep=0"), ["checkpoint.keep"]),
    ("no hang timeout", _set("run.collective_timeout_s=0"), ["run.collective_timeout_s", "greater than 0"]),
    ("unknown schedule", _set("parallel.schedule='zigzag'"), ["parallel.schedule", "1f1b"]),
    ("negative bucket", _set("parallel.bucket_mb=-1"), ["parallel.bucket_mb"]),
    ("no validation data", _set("data.val_fraction=0"), ["data.val_fraction"]),
    ("vocabulary below 256 bytes", _set("model.vocab_size=100"), ["model.vocab_size=100", "256"]),
    ("param on nvme alone", _set("zero.stage=3", "zero.offload_param='nvme'", "zero.nvme_path='{tmp}'"),
     ["offload_optimizer='nvme'"]),
    ("param on cpu, optimizer on nvme", _set("zero.stage=3", "zero.offload_param='cpu'",
                                             "zero.offload_optimizer='nvme'", "zero.nvme_path='{tmp}'"),
     ["offload_param='cpu' with zero.offload_optimizer='nvme'"]),
    ("nvme folder missing", _set("zero.stage=2", "zero.offload_optimizer='nvme'", "zero.nvme_path='{tmp}/nope'"),
     ["zero.nvme_path", "not an existing folder"]),
    ("offload at stage 0", _set("zero.offload_optimizer='cpu'"), ["zero.stage >= 1"]),
    ("reshard at stage 1", _set("zero.stage=1", "zero.reshard_after_forward=false"), ["zero.stage=3"]),
    ("tp does not divide heads", TRAIN + " --nproc 3 --set parallel.tp=3", ["n_head=4", "parallel.tp=3"]),
    ("batch not divisible", _set("train.global_batch=10"), ["train.global_batch=10", "multiple of 8"]),
    ("run name is a path", _set("run.name='..'"), ["run.name"]),
    ("unknown device", _set("run.device='tpu'"), ["run.device"]),
    ("virtual stages without interleaving", _set("parallel.virtual_stages=2"), ["interleaved"]),
    # command-line flags
    ("zero processes", "train --nproc 0", ["parallel.nproc"]),
    ("zero steps", "train --steps 0", ["run.steps"]),
    ("negative restarts", "train --max-restarts -1", ["--max-restarts=-1"]),
    ("fresh and resume", TRAIN + " --fresh --resume", ["--fresh and --resume"]),
    ("override without value", "train --set run.steps", ["section.key=value"]),
    ("override too deep", "train --set a.b.c=1", ["section.key"]),
    ("name with a space", "train --name 'a b'", ["run.name"]),
    ("unknown flag", "train --bogus", ["unrecognized arguments: --bogus"]),
    ("flag missing its value", "memory --params", ["--params", "expected one argument"]),
    ("memory zero dp", "memory --params 1e9 --dp 0 --stage 3", ["--dp=0"]),
    ("memory param offload at stage 2", "memory --params 1e9 --dp 8 --stage 2 --offload-param cpu", ["stage 3"]),
    ("launch zero workers", "launch -n 0 {tmp}/x.py", ["-n 0"]),
    ("launch missing script", "launch -n 2 {tmp}/missing.py", ["does not exist"]),
    ("config file missing", "train {tmp}/nope.toml", ["does not exist"]),
    ("config file not TOML", "train {data}/binary.bin", ["not valid TOML"]),
    ("config file is a folder", "train {data}", ["does not exist"]),
    ("out_dir is a file", TRAIN + " --out-dir {data}/corpus.txt", ["run.out_dir", "is a file"]),
    # data files
    ("data file empty", _set("data.path='{data}/empty.txt'"), ["data.path", "too small"]),
    ("data file binary", _set("data.path='{data}/binary.bin'"), ["data.path", "NUL bytes"]),
    ("data path a folder", _set("data.path='{data}'"), ["data.path", "is a folder"]),
    ("data file missing", _set("data.path='{data}/missing.txt'"), ["data.path", "does not exist"]),
    ("data file too small", _set("data.path='{data}/small.txt'"), ["too small for block_size"]),
    # checkpoints
    ("export: no checkpoint", "export {data} {tmp}/out/model.pt", ["no checkpoint"]),
    ("export: metadata runs code", "export {ckpt}/code {tmp}/out/model.pt", [".metadata", "builtins"]),
    ("export: metadata truncated", "export {ckpt}/truncated {tmp}/out/model.pt", [".metadata", "damaged"]),
    ("export: metadata missing", "export {ckpt}/missing {tmp}/out/model.pt", [".metadata", "missing"]),
    ("export: meta.json malformed", "export {ckpt}/badmeta {tmp}/out/model.pt", ["meta.json"]),
    ("resume: metadata runs code", TRAIN + " --out-dir {ckpt} --name code --resume", [".metadata", "builtins"]),
    ("report: no run", "report {tmp}/nope", ["no metrics.jsonl"]),
    ("report: metrics malformed", "report {data}/badrun", ["metrics.jsonl", "not a podscale metrics file"]),
    # plan inputs
    ("plan: negative devices", SEARCH + " --devices -8", ["--devices"]),
    ("plan: unknown system", "plan --model gpt-175b --system nope --devices 8 --batch 16", ["unknown system 'nope'"]),
    ("plan: unknown model", "plan --model gpt-9 --system dgx-a100-superpod --devices 8 --batch 16",
     ["unknown model 'gpt-9'"]),
    ("plan: model JSON malformed", "plan --model '{layers:' --system dgx-a100-superpod --devices 8 --batch 16",
     ["--model is not valid JSON"]),
    ("plan: model negative layers", "plan --model '{\"layers\":-2,\"hidden\":64,\"heads\":2,\"seq\":8,\"vocab\":10}' "
     "--system dgx-a100-superpod --devices 8 --batch 16", ["'layers'", "positive"]),
    ("predict: layout JSON malformed", PREDICT + f" --model '{M}' --layout '{{tp:'", ["--layout is not valid JSON"]),
    ("predict: layout unknown key", PREDICT + f" --model '{M}' --layout '{L[:-1]},\"foo\":1}}'", ["'foo'"]),
    ("predict: layout not an object", PREDICT + f" --model '{M}' --layout '[1,2]'", ["JSON object"]),
    ("predict: negative microbatch", PREDICT + f" --model '{M}' --layout '{L.replace('16', '-16')}'",
     ["microbatch", "positive"]),
    ("predict: negative tokens", PREDICT + f" --tokens -5 --model '{M}' --layout '{L}'", ["--tokens"]),
    ("predict: layout does not fill devices", PREDICT + f" --model '{M}' --layout '{L.replace('32', '8')}'",
     ["--devices is 32"]),
    ("predict: system file missing", "plan predict --system {tmp}/sys.toml --devices 32 --batch 512 "
     + f"--model '{M}' --layout '{L}'", ["does not exist"]),
    ("plan: JSON output folder missing", SEARCH + " --devices 1024 --json {tmp}/no/dir/out.json", ["--json", "does not exist"]),
]


class _Payload:
    def __reduce__(self):
        return exec, ("open('PWNED', 'w')",)


def _setup(tmp):
    data = tmp / "data"
    data.mkdir()
    (data / "empty.txt").write_bytes(b"")
    (data / "binary.bin").write_bytes(bytes(range(256)) * 64)
    (data / "small.txt").write_text("hello")
    (data / "corpus.txt").write_text("to be or not to be " * 500)
    (data / "badrun").mkdir()
    (data / "badrun" / "metrics.jsonl").write_text("{not json\n")
    (tmp / "x.py").write_text("print('hi')\n")
    for name in ("code", "truncated", "missing", "badmeta"):
        step = tmp / "ckpt" / name / "checkpoints" / "step_00000001"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save({"model": {"w": torch.ones(2, 2)}}, checkpoint_id=str(step))
        (step / "meta.json").write_text(json.dumps({"step": 1}))
        md = step / ".metadata"
        if name == "code":
            md.write_bytes(pickle.dumps(_Payload()))
        elif name == "truncated":
            md.write_bytes(md.read_bytes()[:40])
        elif name == "missing":
            md.unlink()
        else:
            (step / "meta.json").write_text("{step: ")


def _snapshot(folder):
    return sorted((str(p.relative_to(folder)), p.stat().st_size if p.is_file() else -1) for p in folder.rglob("*"))


def test_the_corpus_is_large_enough():
    assert len(CASES) >= 40 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("what,argv,words", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_exit_2_nothing_written(tmp_path, monkeypatch, capsys, what, argv, words):
    _setup(tmp_path)
    monkeypatch.chdir(tmp_path)

    def no_workers(*args, **kwargs):
        raise AssertionError(f"{what}: accepted, and workers were about to start")
    monkeypatch.setattr("podscale.runtime.launcher.launch", no_workers)
    before = _snapshot(tmp_path)
    places = {"{tmp}": str(tmp_path), "{data}": str(tmp_path / "data"), "{ckpt}": str(tmp_path / "ckpt")}
    args = shlex.split(argv)
    for key, value in places.items():
        args = [a.replace(key, value) for a in args]
    try:
        code = main(args)
    except SystemExit as exit_:  # argparse
        code = exit_.code
    out = capsys.readouterr()
    err = out.err.strip()
    assert code == 2, (what, code, err[-500:])
    assert err.startswith("podscale: error: ") and "\n" not in err, err
    for w in words:
        assert w in err, (w, err)
    assert _snapshot(tmp_path) == before, "something was written"
    assert not (tmp_path / "PWNED").exists() and not os.path.exists("PWNED")
