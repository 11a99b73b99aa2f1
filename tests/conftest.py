from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SHARED_DATA = ROOT.parent / "shared" / "data"
SHAKESPEARE = SHARED_DATA / "tinyshakespeare" / "input.txt"


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    # Measured peaks are cached per machine; tests share one cache folder but never the user's.
    monkeypatch.setenv("PODSCALE_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
    # multi-process tests put several gloo ranks on this host, also on a machine with one GPU
    monkeypatch.setenv("PODSCALE_DEVICE", "cpu")


def shakespeare() -> str:
    if not SHAKESPEARE.is_file():
        pytest.skip(f"{SHAKESPEARE} not found (the project's shared data folder)")
    return str(SHAKESPEARE)
