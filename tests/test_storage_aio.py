"""podscale.storage.aio: O_DIRECT transfers (aligned in place, unaligned through bounce buffers with
read-modify-write of edge blocks) and the buffered fallback on file systems that refuse O_DIRECT."""
import errno
import fcntl
import logging
import os

import pytest
import torch

from podscale.storage import aio
from podscale.storage.aio import ALIGN, AsyncFile, aligned_empty, measure_sequential_bandwidth, round_up


def _fs_takes_direct(folder) -> bool:
    try:
        fd = os.open(folder / ".probe", os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return False
    os.close(fd)
    (folder / ".probe").unlink()
    return True


def _round_trip(f: AsyncFile, size: int) -> None:
    """Whole-file write, then unaligned and aligned pieces over it, read back aligned and unaligned."""
    g = torch.Generator().manual_seed(0)
    ref = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g)
    f.write(0, ref.clone()).wait()  # an ordinary (64-byte aligned) tensor: bounce path for O_DIRECT
    pieces = [(777, 12_345), (ALIGN * 10, 2 * ALIGN), (5, 3), (size - 100, 100), (ALIGN * 3 + 1, ALIGN * 5)]
    for i, (off, n) in enumerate(pieces):
        x = aligned_empty(n) if off % ALIGN == 0 else torch.empty(n, dtype=torch.uint8)
        x.fill_(i + 1)
        f.write(off, x).wait()
        ref[off:off + n] = i + 1
    out = aligned_empty(size)
    f.read(0, out).wait()
    assert torch.equal(out, ref)
    part = torch.empty(5001, dtype=torch.uint8)
    f.read(3, part).wait()
    assert torch.equal(part, ref[3:5004])
    assert f.bytes_read == size + 5001


def test_aligned_empty_is_page_aligned():
    for n in (1, 1000, 123_457):
        t = aligned_empty(n, torch.float32)
        assert t.data_ptr() % ALIGN == 0 and t.numel() == n and t.dtype == torch.float32


def test_direct_io_round_trip(tmp_path):
    if not _fs_takes_direct(tmp_path):
        pytest.skip(f"{tmp_path} refuses O_DIRECT (the fallback test covers this file system)")
    f = AsyncFile(tmp_path / "x.swp", 3 * (1 << 20) + 7, threads=3, block_bytes=1 << 20)
    try:
        assert f.direct and fcntl.fcntl(f.fd, fcntl.F_GETFL) & os.O_DIRECT
        _round_trip(f, f.size)
    finally:
        f.close()
    assert not (tmp_path / "x.swp").exists()


def test_buffered_fallback_when_o_direct_is_refused(tmp_path, monkeypatch, caplog):
    def refuse(path):
        raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
    monkeypatch.setattr(aio, "_open_direct", refuse)
    monkeypatch.setattr(aio, "_warned_buffered", False)
    with caplog.at_level(logging.WARNING, logger="podscale.storage"):
        files = [AsyncFile(tmp_path / f"{i}.swp", (1 << 20) + 3, block_bytes=1 << 18) for i in range(2)]
    try:
        assert not any(f.direct for f in files)
        assert not fcntl.fcntl(files[0].fd, fcntl.F_GETFL) & os.O_DIRECT
        said = [r for r in caplog.records if "refuses O_DIRECT" in r.getMessage()]
        assert len(said) == 1  # logged once, not per file
        _round_trip(files[0], files[0].size)
    finally:
        for f in files:
            f.close()


def test_out_of_range_request_is_refused(tmp_path):
    f = AsyncFile(tmp_path / "x.swp", 10_000)
    try:
        with pytest.raises(ValueError, match="outside"):
            f.write(9_000, torch.zeros(2_000, dtype=torch.uint8))
    finally:
        f.close()


def test_sequential_bandwidth_uses_direct_io(tmp_path):
    bw = measure_sequential_bandwidth(tmp_path, 8 << 20, threads=2, block_bytes=1 << 20)
    assert bw["write_Bps"] > 0 and bw["read_Bps"] > 0
    assert bw["direct"] == _fs_takes_direct(tmp_path)
    assert not list(tmp_path.iterdir())


def test_swap_file_never_follows_a_planted_symlink(tmp_path):
    """Issue 11, item 6: a link planted at the (predictable) swap path is refused with one line, and the
    file it points at is neither truncated nor written."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    swap = tmp_path / "x.swp"
    swap.symlink_to(victim)
    with pytest.raises(aio.SwapFileError) as err:
        AsyncFile(swap, 1 << 20, block_bytes=1 << 18)
    msg = str(err.value)
    assert "\n" not in msg and str(swap) in msg and "symbolic link" in msg and "remove the link" in msg
    assert victim.read_text() == "precious"
    assert swap.is_symlink()  # podscale does not delete what it did not create either
    # a dangling link (pointing where a file would be created) is refused the same way
    dangling = tmp_path / "y.swp"
    dangling.symlink_to(tmp_path / "would-be-created")
    with pytest.raises(aio.SwapFileError):
        AsyncFile(dangling, 1 << 20, block_bytes=1 << 18)
    assert not (tmp_path / "would-be-created").exists()


def test_swap_file_is_private_and_replaces_a_leftover_file(tmp_path):
    old = tmp_path / "x.swp"
    old.write_text("left by someone")
    os.chmod(old, 0o666)
    f = AsyncFile(old, 1 << 20, block_bytes=1 << 18)
    try:
        st = os.fstat(f.fd)
        assert st.st_mode & 0o777 == 0o600  # created afresh by this process (not the 0666 file reused)
        assert st.st_size == round_up(1 << 20)
        assert os.stat(old).st_mode & 0o777 == 0o600
    finally:
        f.close()
