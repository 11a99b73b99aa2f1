"""`podscale train --layout auto`: the planner picks the fastest layout the trainer accepts, and trains with it."""
import subprocess
import sys

from podscale.config import apply_override, load_config, parse_config
from podscale.plan import Layout, predict
from podscale.plan.auto import choose_layout, gpt_of, layout_overrides

CONFIG = """
[run]
name = "auto"
out_dir = "{out}"
steps = 2
log_every = 1
sample_tokens = 0

[model]
n_layer = 4
n_head = 4
n_embd = 64
block_size = 64

[parallel]
nproc = 2

[train]
global_batch = 8
micro_batch = 2
"""


def _config(tmp_path):
    path = tmp_path / "cfg.toml"
    path.write_text(CONFIG.format(out=tmp_path / "runs"))
    return path


def test_choose_layout_is_the_fastest_runnable_and_fits(tmp_path):
    cfg = load_config(_config(tmp_path))
    choice = choose_layout(cfg, 2, "dgx-a100-80g", keep=5)
    assert choice.prediction.fits and choice.evaluated > 10
    times = [p.step_time_s for p, _ in choice.ranked]
    assert times == sorted(times) and times[0] == choice.prediction.step_time_s
    # the overrides make a config the trainer accepts, with the chosen layout
    data = cfg.model_dump(mode="json")
    for item in choice.overrides:
        apply_override(data, item)
    new = parse_config(data)
    new.check_layout(2)
    lay = choice.layout
    assert (new.parallel.tp, new.parallel.pp, new.dp, new.train.micro_batch, new.zero.stage) == \
        (lay.tp, lay.pp, lay.dp, lay.microbatch, lay.zero_stage)
    # no runnable layout is predicted faster than the choice
    model = gpt_of(cfg)
    for tp, pp in ((1, 1), (2, 1), (1, 2)):
        other = Layout(tp=tp, pp=pp, dp=2 // (tp * pp), microbatch=2)
        assert predict("dgx-a100-80g", 2, model, other, 8).step_time_s >= choice.prediction.step_time_s
    assert layout_overrides(lay) == choice.overrides


def test_train_layout_auto_prints_the_choice_and_trains(tmp_path):
    cmd = [sys.executable, "-m", "podscale.cli", "train", str(_config(tmp_path)), "--layout", "auto",
           "--system", "dgx-a100-80g"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "layout auto: " in out.stdout and "predicted step" in out.stdout
    assert (tmp_path / "runs" / "auto" / "metrics.jsonl").exists()


def test_layout_auto_without_calibration_says_how(tmp_path, monkeypatch, capsys):
    """The refused command through the entry point that `python -m podscale.cli` exits with, in this process
    (the test above runs the command line itself)."""
    from podscale.cli import main
    monkeypatch.setenv("PODSCALE_CACHE", str(tmp_path / "cache"))
    capsys.readouterr()
    code = main(["train", str(_config(tmp_path)), "--layout", "auto"])
    err = capsys.readouterr().err
    assert code != 0
    assert err.startswith("podscale: error: ") and "podscale plan calibrate" in err
    assert err.count("\n") == 1
