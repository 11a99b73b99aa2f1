"""MovieLens-100K click prediction (click = rating >= 4): DLRM trained by `podscale train` (2 ranks,
row-wise sharded tables) beside a logistic-regression baseline on the same split, both scored by test AUC.

    python examples/movielens_auc.py [--data /work/shared/data/movielens-100k/ml-100k.inter] [--steps 1500]

The split is the task's own (:meth:`podscale.tasks.dlrm.ClickArrays.split`: a shuffle seeded by
``run.seed``, ``data.val_fraction`` held out), so both models are scored on the same held-out ratings.
The baseline is logistic regression on the same features: one weight per id of every sparse feature (user,
item, genres, age decade, gender, occupation, zip digit) plus the dense features, L2-regularised, trained
to convergence with L-BFGS.  MovieLens' licence forbids redistribution: this reads it from where it lies.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from podscale.tasks.dlrm import auc_score, read_movielens  # noqa: E402

SEED, VAL = 1337, 0.2


def logistic_regression(train, test, l2: float = 1e-4) -> float:
    """Test AUC of L2-regularised logistic regression on one-hot ids + dense features (L-BFGS)."""
    vocab = {}
    for name in train.names:
        ids = torch.unique(torch.cat([train.sparse[name][0], test.sparse[name][0]]))
        vocab[name] = ids
    sizes = {k: len(v) for k, v in vocab.items()}
    weights = {k: torch.zeros(n, requires_grad=True) for k, n in sizes.items()}
    wd = torch.zeros(train.dense.shape[1], requires_grad=True)
    bias = torch.zeros(1, requires_grad=True)

    index = {id(d): {k: torch.searchsorted(vocab[k], d.sparse[k][0]) for k in d.names} for d in (train, test)}

    def logits(data):
        z = data.dense @ wd + bias
        for k in data.names:
            z = z + F.embedding_bag(index[id(data)][k], weights[k][:, None], data.sparse[k][1], mode="sum").squeeze(1)
        return z

    params = [*weights.values(), wd, bias]
    opt = torch.optim.LBFGS(params, lr=1.0, max_iter=150, history_size=20, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = F.binary_cross_entropy_with_logits(logits(train), train.labels)
        loss = loss + l2 * sum((p ** 2).sum() for p in weights.values())
        loss.backward()
        return loss

    opt.step(closure)
    with torch.no_grad():
        return auc_score(logits(test), test.labels)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "movielens-100k" / "ml-100k.inter"))
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args(argv)
    data = Path(args.data)
    if not data.is_file():
        sys.exit(f"movielens_auc.py: {data} does not exist: pass --data PATH/ml-100k.inter (or u.data)")

    full = read_movielens(data)
    train, test = full.split(VAL, SEED)
    print(f"MovieLens-100K: {len(train)} training and {len(test)} test ratings, "
          f"{float(full.labels.mean()):.1%} clicks (rating >= 4)", flush=True)

    out = Path(args.out_dir or tempfile.mkdtemp(prefix="podscale-ml-"))
    eval_batches = 4
    out.mkdir(parents=True, exist_ok=True)
    config = out / "dlrm-movielens.toml"
    config.write_text(f"""
[run]
name = "dlrm-movielens"
seed = {SEED}
steps = {args.steps}
eval_every = {max(1, args.steps // 5)}
eval_batches = {eval_batches}
log_every = 100

[model]
kind = "dlrm"
data_format = "movielens"
embedding_dim = 16
bottom_mlp = [32]
top_mlp = [64, 32]
sparse_optimizer = "adagrad"
sparse_lr = 0.05

[data]
path = "{data}"
val_fraction = {VAL}

[parallel]
nproc = 2

[train]
global_batch = 256
micro_batch = 128
lr = 2e-3
min_lr = 2e-4
warmup_steps = 50
weight_decay = 0.0
grad_clip = 0.0

[checkpoint]
at_end = false
""")
    cmd = [sys.executable, "-m", "podscale", "train", str(config), "--out-dir", str(out), "--fresh"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(cmd, env=env, text=True)
    if proc.returncode:
        sys.exit(f"movielens_auc.py: podscale train failed (exit {proc.returncode})")
    rows = [json.loads(line) for line in (out / "dlrm-movielens" / "metrics.jsonl").read_text().splitlines()]
    evals = [(r["step"], r["val_auc"]) for r in rows if "val_auc" in r]
    dlrm_auc = evals[-1][1]
    lr_auc = logistic_regression(train, test)
    per = len(test) // eval_batches
    print(f"DLRM (podscale, 2 ranks): test AUC {dlrm_auc:.4f} after {evals[-1][0]} steps "
          f"(on {per * eval_batches} of the {len(test)} test ratings; curve {[(s, round(a, 4)) for s, a in evals]})")
    print(f"logistic regression:      test AUC {lr_auc:.4f}")
    print(f"DLRM - baseline: {dlrm_auc - lr_auc:+.4f}; goal AUC >= 0.78: {'met' if dlrm_auc >= 0.78 else 'not met'}")


if __name__ == "__main__":
    main()
