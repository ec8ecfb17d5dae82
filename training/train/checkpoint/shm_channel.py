"""A socket between two processes that carries pickled objects, each tensor in shared memory as its memory's
file descriptor (SCM_RIGHTS, unix(7)) instead of its bytes: how a rank hands its writer process a save.

A message is a header (pickle length, descriptor count), the descriptors in batches of at most SCM_MAX_FD,
each batch attached to one byte, then the pickle. Nothing else is involved: no listener thread, no
address, no key, no state that a fork must reset (multiprocessing's own fd passing has all four).

The receiver maps each memory once and keeps the last message's mappings: a staging buffer the sender
reuses arrives as the same file (same device and inode) and is read through the pages already mapped,
not through a fresh mapping faulted in again.
"""
from __future__ import annotations

import io
import os
import pickle
import select
import socket
import struct
from typing import Any

import torch

SCM_MAX_FD = 253  # unix(7): the most file descriptors one sendmsg may carry
_HEADER = struct.Struct("!QI")  # pickle bytes, file descriptors
_FileKey = tuple[int, int]  # (st_dev, st_ino): one shared memory, whichever descriptor names it


def readable(fd: Any, timeout_s: float | None) -> bool:
    """Whether `fd` (a descriptor or a socket) reads ready within `timeout_s` (None: wait for ever). poll(2),
    not select(2), which refuses a descriptor past 1023: a rank holds one per staging buffer."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(None if timeout_s is None else timeout_s * 1000))


class _Pickler(pickle.Pickler):
    """Pickles each CPU storage in shared memory as a reference to its descriptor, collected in `fds`."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.fds: list[int] = []

    def persistent_id(self, obj: Any) -> tuple[int, int, torch.dtype] | None:
        if not isinstance(obj, torch.storage.TypedStorage):
            return None
        storage = obj._untyped_storage
        if storage.device.type != "cpu" or not storage.is_shared() or storage.nbytes() == 0:
            return None  # pickled by value
        fd, size = storage._share_fd_cpu_()  # the storage's own descriptor, open while the storage lives
        self.fds.append(fd)
        return len(self.fds) - 1, size, obj.dtype


class _Unpickler(pickle.Unpickler):
    """Maps each referenced memory, reusing the previous message's mapping of the same file."""

    def __init__(self, file: io.BytesIO, fds: list[int], previous: dict[_FileKey, torch.UntypedStorage]) -> None:
        super().__init__(file)
        self._fds, self._previous = fds, previous
        self.mapped: dict[_FileKey, torch.UntypedStorage] = {}

    def persistent_load(self, pid: tuple[int, int, torch.dtype]) -> torch.storage.TypedStorage:
        index, size, dtype = pid
        stat = os.fstat(self._fds[index])
        key = (stat.st_dev, stat.st_ino)
        storage = self.mapped.get(key) or self._previous.get(key)
        if storage is None:
            storage = torch.UntypedStorage._new_shared_fd_cpu(self._fds[index], size)  # maps a dup of the fd
        self.mapped[key] = storage
        return torch.storage.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)


class ShmChannel:
    """One end of the socket. Not thread-safe: one sender and one receiver at a time per end."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._mapped: dict[_FileKey, torch.UntypedStorage] = {}

    def send(self, obj: Any) -> None:
        buffer = io.BytesIO()
        pickler = _Pickler(buffer)
        pickler.dump(obj)
        payload = buffer.getbuffer()
        self._sock.sendall(_HEADER.pack(len(payload), len(pickler.fds)))
        for start in range(0, len(pickler.fds), SCM_MAX_FD):
            socket.send_fds(self._sock, [b"\0"], pickler.fds[start:start + SCM_MAX_FD])
        self._sock.sendall(payload)

    def recv(self, timeout: float | None = None) -> Any:
        """The next object; EOFError once the other end is closed; TimeoutError when no message began within
        `timeout` seconds (None: wait for ever). A message whose descriptors did not all arrive (the
        receiver's descriptor limit) is read to its end and refused with OSError, so the next one can still
        be read."""
        if timeout is not None and not readable(self._sock, timeout):
            raise TimeoutError(f"shm channel: no message within {timeout:g} s")
        size, count = _HEADER.unpack(self._read(_HEADER.size))
        fds: list[int] = []
        truncated = False
        try:
            for _ in range(-(-count // SCM_MAX_FD)):  # every batch, also after a truncated one
                data, batch, flags, _ = socket.recv_fds(self._sock, 1, SCM_MAX_FD)
                if not data:
                    raise EOFError("shm channel closed mid-message")
                fds += batch
                truncated |= bool(flags & socket.MSG_CTRUNC)
            payload = self._read(size)
            if truncated:
                raise OSError(f"shm channel: {len(fds)} of {count} file descriptors arrived (RLIMIT_NOFILE?)")
            unpickler = _Unpickler(io.BytesIO(payload), fds, self._mapped)
            obj = unpickler.load()
            self._mapped = unpickler.mapped
            return obj
        finally:
            for fd in fds:
                os.close(fd)

    def close(self) -> None:
        self._sock.close()

    def _read(self, n: int) -> bytearray:
        """Exactly n bytes: never a byte more, which could carry the next message's descriptors."""
        buffer = bytearray(n)
        view = memoryview(buffer)
        got = 0
        while got < n:
            received = self._sock.recv_into(view[got:])
            if received == 0:
                raise EOFError("shm channel closed")
            got += received
        return buffer
