"""Reading DCP checkpoints without running code from them.

``torch.distributed.checkpoint``'s :class:`FileSystemReader` reads the ``.metadata`` file with
``pickle.load``, so a crafted checkpoint could run any code when it is loaded; and a checkpoint whose
metadata declares a non-tensor ("bytes") entry is loaded with ``torch.load(weights_only=False)``.
:class:`SafeFileSystemReader` reads ``.metadata`` through an allow-list unpickler that can build only the
DCP metadata classes and the few torch and standard-library values they hold (dtypes, ``torch.Size``, the
strided layout, paths), then checks the result: every entry is a tensor (podscale writes nothing else) and
every storage file is a plain name inside the checkpoint folder.  Anything else raises
:class:`UnsafeCheckpointError`, one line naming the file and the fix.  ``--resume``, reshard loads and
``export`` read checkpoints only through this reader.
"""
from __future__ import annotations

import io
import os
import pathlib
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import filesystem as _fs
from torch.distributed.checkpoint import metadata as _md

# module -> names the unpickler may build: the DCP metadata classes, and what their fields hold.
_ALLOWED: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset({
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING"}),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch": frozenset({"Size"}),              # dtypes are checked by value in find_class
    "torch.serialization": frozenset({"_get_layout"}),  # maps a layout's name ('torch.strided') to it
    "pathlib": frozenset({"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"}),
    "collections": frozenset({"OrderedDict"}),
}


class UnsafeCheckpointError(ValueError):
    """A checkpoint podscale refuses to read; the message is one line naming the file and the fix."""


def _refuse(path, what: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        f"checkpoint metadata '{path}' {what}, which a podscale checkpoint never holds: it was not written by "
        "podscale or was altered; load only checkpoints you wrote, or write a new one")


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, path):
        super().__init__(file)
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and name not in _ALLOWED["torch"]:
            value = getattr(torch, name, None)
            if isinstance(value, torch.dtype):
                return value
        elif name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        raise _refuse(self._path, f"asks to load '{module}.{name}'")

    def persistent_load(self, pid):
        raise _refuse(self._path, "holds a persistent reference")


def load_metadata(data: bytes, path) -> _md.Metadata:
    """Unpickle ``data`` (the bytes of ``path``) with the allow-list and check what it describes."""
    try:
        md = _MetadataUnpickler(io.BytesIO(data), path).load()
    except UnsafeCheckpointError:
        raise
    except Exception as err:  # truncated or damaged: whatever the unpickler raised
        raise UnsafeCheckpointError(f"checkpoint metadata '{path}' is not readable ({type(err).__name__}: "
                                    f"{err}): the checkpoint is damaged; use an earlier one") from None
    if not isinstance(md, _md.Metadata):
        raise _refuse(path, f"holds a {type(md).__name__} instead of DCP metadata")
    if not isinstance(md.state_dict_metadata, dict):
        raise _refuse(path, "has no table of entries")
    for key, entry in md.state_dict_metadata.items():
        if not isinstance(entry, _md.TensorStorageMetadata):
            raise _refuse(path, f"declares '{key}' as {type(entry).__name__} (loaded with pickle)")
    for index, info in (md.storage_data or {}).items():
        rel = info.relative_path if isinstance(info, _fs._StorageInfo) else None
        if not isinstance(rel, str) or rel in ("", ".", "..") or "/" in rel or "\\" in rel:
            raise _refuse(path, f"points an entry at the file {rel!r} outside the checkpoint folder")
    return md


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with ``.metadata`` read through the allow-list unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> _md.Metadata:
        rank = kwargs.get("rank")  # (DCP's own naming: one file, or one per rank when saved without collectives)
        path = self.fs.concat_path(self.path, ".metadata" if rank is None else f"__{rank}.metadata")
        try:
            with self.fs.create_stream(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            raise UnsafeCheckpointError(f"checkpoint metadata '{path}' is missing: the checkpoint is "
                                        "incomplete; use an earlier one") from None
        md = load_metadata(data, path)
        if md.storage_meta is None:
            md.storage_meta = _md.StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


__all__ = ["SafeFileSystemReader", "UnsafeCheckpointError", "load_metadata"]
