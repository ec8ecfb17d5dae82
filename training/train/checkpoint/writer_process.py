"""The writer process: writes a rank's checkpoint shards outside the training process.

An async save on CPU runs DCP's `async_save` in a background thread of the training process, which does
the planning, the collectives and rank 0's `.metadata` (small), and hands each rank's shard write, the
CPU-heavy part (serialising every tensor, the write, fsync), to this process. In a
thread of the training process that write would hold the GIL against the training loop and count as the
rank's CPU time (bench/stall.py measures the two processes apart).

The staged tensors are not copied again on the way: they live in shared memory (DefaultStager with
use_shared_memory, reused from save to save), and a request pickles each of them as a reference to its
memory's file descriptor, which travels beside the pickle over this process's own socket (SCM_RIGHTS,
unix(7)). multiprocessing's way, a listener thread in the training process that the writer connects to
once per tensor, is not used: a rank forked with os.fork (training.pod.prefork) without multiprocessing's
after-fork hooks inherits that listener's state without its thread, and every handle fetched from it
fails; the listener also costs the training process a connection and an HMAC handshake per tensor.

Protocol, one write in flight: the parent sends WriteRequest(path, plan, data); the process answers with
the list of WriteResults or with the exception the write raised. It never commits anything (the training
process's rank 0 does, layout.commit), so a writer process outliving its training iteration can at most
leave files in an uncommitted `.tmp-` directory. It dies with its parent (PR_SET_PDEATHSIG) and when its
socket closes; `abort()` kills it mid-write. Signals to the rank's process group (a drain's SIGTERM) do not
reach it: a drain waits for the write in flight to commit.
"""
from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, TypeVar

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, WriteItem
from torch.distributed.checkpoint.storage import WriteResult

from training.train.checkpoint.direct_io import DirectFileSystem
from training.train.checkpoint.shm_channel import ShmChannel

T = TypeVar("T")
_PR_SET_PDEATHSIG = 1  # prctl(2): the signal this process gets when its parent thread exits


@dataclass(frozen=True)
class WriteRequest:
    path: Path  # the save's `.tmp-` directory
    plan: SavePlan  # this rank's final local plan (its items and DCP's file prefix for the rank)
    data: dict[MetadataIndex, Any]  # each item's resolved data: a tensor in shared memory, or BytesIO


class WriterProcessDied(RuntimeError):
    """The writer process ended while a write was in flight (killed, out of memory): the save fails,
    and the next save starts a new process."""


class _Resolved:
    """The one thing FileSystemWriter.write_data asks of its planner: each item's data."""

    def __init__(self, data: dict[MetadataIndex, Any]) -> None:
        self._data = data

    def resolve_data(self, item: WriteItem) -> Any:
        return self._data[item.index]


def _serve(channel: ShmChannel) -> None:
    """The writer process's main loop: one request at a time until the socket closes."""
    while True:
        try:
            request: WriteRequest = channel.recv()
        except EOFError:
            return
        except Exception as err:  # noqa: BLE001 (a request that could not be read fails its save, not the process)
            channel.send(err)
            continue
        try:
            # DCP's own writer, with the same defaults as the training process's (one file per rank, fsync),
            # its shard file written around the page cache (direct_io.py).
            writer = dcp.FileSystemWriter(request.path)
            writer.fs = DirectFileSystem()
            written = writer.write_data(request.plan, _Resolved(request.data))
            written.wait()
            answer: list[WriteResult] | BaseException = written.value()
        except BaseException as err:  # noqa: BLE001 (any failure of the write is the save's, sent back)
            answer = err
        try:
            channel.send(answer)
        except OSError:  # the rank is gone (killed mid-save): nobody to answer
            return


class WriterProcess:
    """The parent's handle on one writer process, started at once (importing torch takes a while, and
    costs the training process nothing). After it died or was aborted, `shared_writer_process` starts
    another; a save thread that still holds this handle can only fail (WriterProcessDied), never reach
    the next process.

    A plain `python -m` of this module, not multiprocessing's spawn: spawn re-runs the parent's main
    script in the child unless it is guarded, and the training runs from several (ft_launcher's `-m`,
    prefork's runpy, tests' scripts). Call from the training thread: PR_SET_PDEATHSIG fires when the
    thread that started the process ends."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair()
        package_root = str(Path(__file__).resolve().parents[3])  # where `training` is importable from
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (package_root, os.environ.get("PYTHONPATH"))))}
        # A process group of its own: ft_launcher stops (and a drain signals) a rank with SIGTERM to the rank's
        # group (os.killpg), which would end a write the drain is waiting to commit. Its life is its parent's
        # (PR_SET_PDEATHSIG) and abort()'s, not its group's.
        self._process = subprocess.Popen([sys.executable, "-m", __name__, str(theirs.fileno())],
                                         pass_fds=[theirs.fileno()], env=env, process_group=0)
        theirs.close()
        self._channel = ShmChannel(ours)
        self._one_write = threading.Lock()  # two managers of one process (tests) take turns
        self._ready = False  # its first message (None) came: its imports are done

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def running(self) -> bool:
        return self._process.poll() is None

    def wait_ready(self) -> None:
        """Block until the process has imported torch and DCP (seconds after its start, more on a loaded
        host), so that the wait lands where the caller chooses (the rank's setup) rather than in its first
        saves: there a save waiting for the one before it can outlast NVRx's checkpoint section timeout,
        calculated from quick saves, and the rank monitor kills the rank."""
        self._exchange(lambda: None)

    def write(self, request: WriteRequest) -> list[WriteResult]:
        """Write one rank's shards (blocks the calling thread, not the CPU); raises what the write raised."""
        def send_and_receive() -> list[WriteResult] | BaseException:
            self._channel.send(request)
            return self._channel.recv()

        answer = self._exchange(send_and_receive)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def _exchange(self, talk: Callable[[], T]) -> T:
        try:
            with self._one_write:
                if not self._ready:
                    self._channel.recv()
                    self._ready = True
                return talk()
        except (EOFError, OSError) as err:
            raise WriterProcessDied(f"checkpoint writer process {self.pid} died "
                                    f"(exit code {self._process.wait()})") from err

    def abort(self) -> None:
        """The iteration dies: kill the process whatever it is doing (a save thread waiting on it gets
        WriterProcessDied). Its `.tmp-` directory stays uncommitted (only the training process commits)
        and is removed by the next manager."""
        if self.running:
            self._process.kill()
            self._process.wait()


_shared: WriterProcess | None = None


def shared_writer_process() -> WriterProcess:
    """This process's writer process, running: one per process, not one per CheckpointManager, so that the
    next manager (after a clean close; a test's) does not pay a new interpreter's imports of torch and DCP
    again (3-5 CPU-s here). It ends with this process, or by an abort (then the next call starts anew)."""
    global _shared
    if _shared is None or not _shared.running:
        _shared = WriterProcess()
    return _shared


def _forget_the_parents_writer() -> None:
    """In a forked child: the parent's writer is the parent's (its socket would mix both processes'
    requests). os.fork runs this hook also where multiprocessing's own are not run (training.pod.prefork)."""
    global _shared
    _shared = None


os.register_at_fork(after_in_child=_forget_the_parents_writer)


def _main(fd: int) -> None:
    if sys.platform == "linux":  # a SIGKILLed training process must not leave its writer running
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    # Serialising and writing need no intra-op parallelism; torch's default (a thread per CPU) would
    # spin threads on the CPUs the training ranks use.
    torch.set_num_threads(1)
    # The zip checksum torch.save computes over every byte is two thirds of this process's CPU time per
    # save, and torch.load never checks it (a flipped data byte loads silently, tried with torch 2.13);
    # inspection.py's evidence of damage (missing, short files) does not use it. set_crc32_options (torch docs,
    # "Serialization semantics") turns it off for this process only.
    torch.serialization.set_crc32_options(False)
    channel = ShmChannel(socket.socket(fileno=fd))
    channel.send(None)  # ready: imports done
    _serve(channel)


if __name__ == "__main__":
    _main(int(sys.argv[1]))
