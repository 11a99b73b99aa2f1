from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
# Tests need nothing outside the repository: Tiny Shakespeare (public domain) is committed under tests/data.
SHAKESPEARE = Path(__file__).resolve().parent / "data" / "tinyshakespeare.txt"

# The single-process references and in-process checks run in this process on one intra-op thread, as every
# worker does (tp_workers.train_layouts and the others call torch.set_num_threads(1)): the test models are a
# few thousand parameters wide, too small for a second thread to help, and on a shared 2-core machine two
# OpenMP threads that spin-wait for each other made a 20-step reference run ~25x slower (measured: 5 steps of
# the 8-block pipeline model, 27 s with 2 threads against 1.1 s with 1, under load).
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    # Measured peaks are cached per machine; tests share one cache folder but never the user's.
    monkeypatch.setenv("PODSCALE_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
    # multi-process tests put several gloo ranks on this host, also on a machine with one GPU
    monkeypatch.setenv("PODSCALE_DEVICE", "cpu")
    # collectives refuse tensors allocated on torch's default device: on a GPU mesh that is the CPU, which
    # NCCL refuses, so the CPU suite catches the bug too (podscale.runtime.comm.check_devices)
    monkeypatch.setenv("PODSCALE_STRICT_DEVICE", "1")


def shakespeare() -> str:
    assert SHAKESPEARE.is_file(), f"{SHAKESPEARE} is part of the repository: restore it with git"
    return str(SHAKESPEARE)
