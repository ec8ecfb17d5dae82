"""Shard files written around the page cache (O_DIRECT), for the writer process.

Through the page cache, writing a shard costs the kernel its copy into new cache pages, their dirty
accounting and the flusher's writeback; with O_DIRECT the kernel does none of these, and the write costs
it next to nothing (bench.stall measures the writer's CPU time). Where no CPU is spare, that CPU time
comes out of training whichever process spends it. Durability is unchanged (`DirectFile`). Cost: a
CHUNK-sized buffer per file being written.
"""
from __future__ import annotations

import errno
import fcntl
import io
import mmap
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Generator

from torch.distributed.checkpoint.filesystem import FileSystem

BLOCK = 4096  # a multiple of every logical block size O_DIRECT may ask for (512 B disks, 4 KiB ones)
CHUNK = 8 << 20  # bytes gathered before each direct write: large writes, a small buffer


class DirectFile(io.RawIOBase):
    """A write-only file opened with O_DIRECT, written in CHUNK-sized aligned writes.

    O_DIRECT wants the memory, the file offset and the length of every write aligned to the device's logical
    block size (open(2), "O_DIRECT"). DCP's writes are gathered in an aligned buffer, whole buffers are
    written, and the unaligned tail of the file goes through the page cache after clearing O_DIRECT (fcntl(2)
    F_SETFL). Durability is unchanged: DCP fsyncs each file before the save returns, and the commit
    (`layout`) runs only after that.

    DCP asks for the file descriptor only to fsync it after its last write, so `fileno()` first writes
    out the buffered tail; a write after that is refused."""

    def __init__(self, fd: int) -> None:
        super().__init__()
        self._fd = fd
        self._buf = mmap.mmap(-1, CHUNK)  # anonymous mappings are page-aligned
        self._filled = 0  # bytes in the buffer
        self._written = 0  # bytes in the file
        self._finished = False

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:  # noqa: ANN001 (any bytes-like object)
        if self._finished:
            raise ValueError("DirectFile: write after its tail was written (fileno() was asked for)")
        with memoryview(data) as view, view.cast("B") as octets:
            taken = 0
            while taken < len(octets):
                n = min(len(octets) - taken, CHUNK - self._filled)
                self._buf[self._filled:self._filled + n] = octets[taken:taken + n]
                self._filled += n
                taken += n
                if self._filled == CHUNK:
                    self._write_buffer(CHUNK)
            return taken

    def tell(self) -> int:
        return self._written + self._filled

    def flush(self) -> None:
        """Nothing: only whole blocks can be written directly; the tail waits for `fileno()` or `close()`."""

    def fileno(self) -> int:
        self._finish()
        return self._fd

    def close(self) -> None:
        if self.closed:
            return
        try:
            self._finish()
        finally:
            os.close(self._fd)
            self._buf.close()
            super().close()

    def _finish(self) -> None:
        if self._finished:
            return
        self._finished = True
        whole = self._filled - self._filled % BLOCK
        tail = self._filled - whole
        self._write_buffer(whole)
        if tail:
            fcntl.fcntl(self._fd, fcntl.F_SETFL, fcntl.fcntl(self._fd, fcntl.F_GETFL) & ~os.O_DIRECT)
            self._write_buffer(tail)

    def _write_buffer(self, n: int) -> None:
        """Write the buffer's first n bytes; the rest (under a block) moves to its start."""
        with memoryview(self._buf) as buf:
            done = 0
            while done < n:
                done += os.write(self._fd, buf[done:n])
            rest = self._filled - n
            buf[:rest] = buf[n:self._filled]
        self._written += n
        self._filled = rest


def open_direct(path: Path) -> io.RawIOBase:
    """`path` opened for writing around the page cache, or through it where its file system refuses O_DIRECT
    (EINVAL, e.g. tmpfs): a plain buffered file."""
    try:
        return DirectFile(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644))
    except OSError as err:
        if err.errno != errno.EINVAL:
            raise
        return open(path, "wb")  # noqa: SIM115 (the caller closes it)


class DirectFileSystem(FileSystem):
    """DCP's local file system, its files for writing opened with `open_direct`."""

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase, None, None]:
        if mode != "wb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with open_direct(Path(path)) as stream:
            yield stream
