"""The run directory: where it may be, what marks it as podscale's, and what ``--fresh`` may delete.

``run.name`` is one plain path component (the config rejects ``.``, ``..`` and separators), and the run
directory must resolve to a direct child of ``run.out_dir`` (a name that is a symlink to elsewhere is
refused).  When podscale creates a run directory it writes the marker file :data:`MARKER` into it;
``--fresh`` deletes only a directory that holds the marker.  Anything else is a :class:`RunDirError`
(one line, exit code 2) and nothing is touched.  Torch-free, so the CLI checks it before workers start.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

MARKER = ".podscale-run"
_MARKER_TEXT = "This folder was created by podscale; `podscale train --fresh` may delete it.\n"


class RunDirError(ValueError):
    """A run directory podscale must not use or delete; the message is one line with the fix."""


def resolve_run_dir(out_dir: str | os.PathLike, name: str) -> Path:
    """``out_dir / name``, checked to resolve to a direct child of ``out_dir``."""
    if name in ("", ".", "..") or "/" in name or "\\" in name or (os.altsep and os.altsep in name):
        raise RunDirError(f"run.name='{name}' is not a plain folder name: use letters, digits, '_', '-' "
                          "and '.', not '.', '..' or a path")
    for parent in (Path(os.path.expanduser(out_dir)), *Path(os.path.expanduser(out_dir)).parents):
        if parent.exists() and not parent.is_dir():
            raise RunDirError(f"run.out_dir '{out_dir}' cannot be a folder: '{parent}' is a file; choose "
                              "another run.out_dir")
    out = Path(os.path.expanduser(out_dir)).resolve()
    run_dir = Path(os.path.expanduser(out_dir)) / name
    if run_dir.resolve().parent != out or run_dir.resolve() == out:
        raise RunDirError(f"run directory '{run_dir}' resolves to '{run_dir.resolve()}', outside run.out_dir "
                          f"'{out}' (a symlink?): remove the link or choose another run.name")
    return run_dir


def is_marked(run_dir: Path) -> bool:
    """True when ``run_dir`` is a real directory (not a symlink) that podscale created."""
    return run_dir.is_dir() and not run_dir.is_symlink() and (run_dir / MARKER).is_file()


def check_fresh(run_dir: Path) -> None:
    """Raise unless ``--fresh`` may delete ``run_dir`` (absent, or a directory podscale marked as its own)."""
    if not os.path.lexists(run_dir):
        return
    if not is_marked(run_dir):
        raise RunDirError(f"--fresh deletes only run directories podscale created, and '{run_dir}' has no "
                          f"{MARKER} marker: delete it yourself or choose another run.name")


def prepare(run_dir: Path, fresh: bool) -> None:
    """Create ``run_dir`` (with its marker) for a run; with ``fresh``, first delete a marked one.

    Call :func:`check_fresh` before anything else is done, so that a refusal leaves everything untouched.
    """
    if fresh:
        check_fresh(run_dir)
        if run_dir.exists():
            shutil.rmtree(run_dir)
    try:
        run_dir.mkdir(parents=True)
    except FileExistsError:
        if not run_dir.is_dir():
            raise RunDirError(f"run directory '{run_dir}' exists and is not a folder: remove it or choose "
                              "another run.name") from None
        return  # an existing run directory (resumed, or made by hand): use it, never mark it
    (run_dir / MARKER).write_text(_MARKER_TEXT)
