"""The writer process: writes a rank's checkpoint shards outside the training process.

An async save on CPU runs DCP's `async_save` (planning, collectives, rank 0's `.metadata`) in a thread
of the training process, and hands each rank's shard write, the CPU-heavy part (serialising, the
write, fsync), to this process: in a thread of the training process it would hold the GIL against the
training loop and count as the rank's CPU time. The staged tensors travel as file descriptors of their
shared memory (`staging`'s buffers) over this process's own socket (SCM_RIGHTS, unix(7)), not copied.
It never commits (rank 0's training process does, `layout.commit`). Cost: one process per rank, forked
from the rank's zygote (`_Zygote`), and every wait on it bounded by `deadline_s`. The protocol and how
stuck or dead writers are replaced: docs/training.md, "Async saves".
"""
from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import socket
import struct
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
from training.train.checkpoint.shm_budget import raise_fd_limit
from training.train.checkpoint.shm_channel import ShmChannel, readable

log = logging.getLogger(__name__)

T = TypeVar("T")
# How long an abort or a replacement waits for a SIGKILLed process to end: one that is not in uninterruptible
# I/O ends within milliseconds; waiting longer for one that is would hold an in-process restart up.
_KILL_GRACE_S = 5.0
_PR_SET_PDEATHSIG = 1  # prctl(2): the signal this process gets when its parent thread exits


@dataclass(frozen=True)
class WriteRequest:
    path: Path  # the save's `.tmp-` directory
    plan: SavePlan  # this rank's final local plan (its items and DCP's file prefix for the rank)
    data: dict[MetadataIndex, Any]  # each item's resolved data: a tensor in shared memory, or BytesIO


class WriterProcessDied(RuntimeError):
    """The writer process ended while a write was in flight (killed, out of memory): the save fails,
    and the next save starts a new process."""


class WriterTimedOut(WriterProcessDied):
    """The writer process gave no answer within its deadline: the save fails, the process is killed and
    abandoned, and the next save starts a new one."""


class ZygoteLost(WriterProcessDied):
    """The zygote did not fork a writer when asked (it died, or gave no answer within the deadline)."""


@dataclass(frozen=True)
class Replaced:
    """A rank's checkpoint writer found dead or stuck, and the one that took its place."""
    process: str  # "zygote", "writer" or "nvrx_worker" (NVRx's persistent worker, training.train.checkpoint.writers)
    pid: int
    new_pid: int | None  # None: it starts at the next save
    reason: str


def _kill_and_wait(pidfd: int, grace_s: float) -> bool:
    """SIGKILL the process of `pidfd`; whether it ended within `grace_s`."""
    with contextlib.suppress(ProcessLookupError):
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    return readable(pidfd, grace_s)  # a pidfd reads ready once its process ended (pidfd_open(2))


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
            # its shard file written around the page cache (`direct_io`). No copy ahead: the staged data is on
            # the CPU already, and with it FileSystemWriter loads through a CUDA stream wherever CUDA is
            # available (_OverlappingCpuLoader, torch 2.13), a CUDA context on GPU 0 per rank's writer. torch's
            # own FileSystemWriter.stage turns it off for async saves the same way.
            writer = dcp.FileSystemWriter(request.path, per_thread_copy_ahead=0)
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


def _die_with_parent() -> None:
    """This process gets SIGKILL when the thread that started it exits (prctl(2) PR_SET_PDEATHSIG): a
    SIGKILLed training process leaves no zygote or writer behind."""
    if sys.platform == "linux":
        parent = os.getppid()
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before the prctl took effect
            os._exit(0)


class _Zygote:
    """A process with torch and DCP imported and no thread but its main one, that forks a writer process
    when asked: a writer starts in milliseconds (a fork), not seconds (a new interpreter importing torch),
    whenever it is needed: at a rank's first save, after an in-process restart's abort killed the last
    one, after one died. Forked from the rank before its first thread (`start_zygote`, from
    training.train's main: a fork is safe only there), else started as a new interpreter once per process.

    A request is one byte carrying the writer's end of a new socket pair (SCM_RIGHTS); the answer is the
    writer's pid. The zygote leads a process group of its own, its writers' too: ft_launcher's stop and a
    drain's SIGTERM go to the rank's group (os.killpg) and must not end a write a drain waits to commit.
    Their lives are the rank's: PR_SET_PDEATHSIG, and the zygote leaves when its socket closes."""

    _PID = struct.Struct("!i")

    def __init__(self, sock: socket.socket, pid: int) -> None:
        self._sock, self.pid = sock, pid
        self._pidfd = os.pidfd_open(pid)  # the zygote itself, whoever reaps it and reuses its pid
        self._lock = threading.Lock()

    @classmethod
    def start(cls) -> _Zygote:
        """Forked where that is safe (no thread but the main one: a fork copies no other thread, and a lock
        another thread held stays held in the child), else a new interpreter."""
        return cls.fork() if threading.active_count() == 1 else cls.spawn()

    @classmethod
    def fork(cls) -> _Zygote:
        ours, theirs = socket.socketpair()
        pid = os.fork()
        if pid == 0:  # the zygote; it never returns into the rank's code
            try:
                ours.close()
                _die_with_parent()
                os.setpgid(0, 0)
                _zygote_loop(theirs)
            finally:
                os._exit(0)
        theirs.close()
        return cls(ours, pid)

    @classmethod
    def spawn(cls) -> _Zygote:
        ours, theirs = socket.socketpair()
        package_root = str(Path(__file__).resolve().parents[3])  # where `training` is importable from
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (package_root, os.environ.get("PYTHONPATH"))))}
        # A plain `python -m`, not multiprocessing's spawn: spawn re-runs the parent's main script in the
        # child unless it is guarded, and the training runs from several (ft_launcher's `-m`, prefork's
        # runpy, tests' scripts). Call from the thread that lives as long as the process (PR_SET_PDEATHSIG).
        process = subprocess.Popen([sys.executable, "-m", __name__, str(theirs.fileno())],
                                   pass_fds=[theirs.fileno()], env=env, process_group=0)
        theirs.close()
        return cls(ours, process.pid)

    def new_writer(self, deadline_s: float) -> WriterProcess:
        """A new writer process; ZygoteLost if the zygote is gone or gives no answer within `deadline_s` (a
        new interpreter answers once it has imported torch: seconds)."""
        ours, theirs = socket.socketpair()
        try:
            with self._lock:
                self._sock.settimeout(deadline_s)
                socket.send_fds(self._sock, [b"W"], [theirs.fileno()])
                answer = self._sock.recv(self._PID.size, socket.MSG_WAITALL)
        except OSError as err:  # BrokenPipeError, ConnectionResetError: it died; TimeoutError: it is stuck
            ours.close()
            raise ZygoteLost(f"checkpoint writer zygote {self.pid} did not answer: {type(err).__name__}: {err}") from err
        finally:
            theirs.close()
        if len(answer) != self._PID.size:
            ours.close()
            raise ZygoteLost(f"checkpoint writer zygote {self.pid} is gone")
        return WriterProcess(self._PID.unpack(answer)[0], ShmChannel(ours))

    def close(self) -> None:
        """Kill it (it may be alive but stuck), reap it where it ended (it is this process's child), release
        its socket."""
        self._sock.close()
        if _kill_and_wait(self._pidfd, _KILL_GRACE_S):
            with contextlib.suppress(ChildProcessError):  # reaped already (subprocess's own clean-up)
                os.waitid(os.P_PIDFD, self._pidfd, os.WEXITED | os.WNOHANG)
        os.close(self._pidfd)


def _zygote_loop(sock: socket.socket) -> None:
    """Fork a writer for each request until the rank closes the socket."""
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # writers that end are reaped by the kernel
    while True:
        msg, fds, _, _ = socket.recv_fds(sock, 1, 1)
        if not msg:
            return
        pid = os.fork()
        if pid == 0:  # a writer
            try:
                sock.close()
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                _die_with_parent()
                _writer_main(fds[0])
            finally:
                os._exit(0)
        os.close(fds[0])
        sock.sendall(_Zygote._PID.pack(pid))


class WriterProcess:
    """The rank's handle on one writer process (a child of its zygote). After it died, timed out or was
    aborted, `shared_writer_process` forks another; a save thread that still holds this handle can only fail
    (WriterProcessDied), never reach the next process."""

    def __init__(self, pid: int, channel: ShmChannel) -> None:
        self.pid = pid
        self._pidfd: int | None = os.pidfd_open(pid)  # the process itself, whatever reuses its pid later
        self._life = threading.Lock()  # the pidfd: the save thread may kill while the training thread closes
        self._channel = channel
        self._one_write = threading.Lock()  # two managers of one process (tests) take turns
        self._ready = False  # its first message (None) came: it is serving
        self.failure: str | None = None  # why it was abandoned: it gave no answer in time

    @property
    def running(self) -> bool:
        with self._life:  # a pidfd reads ready once its process ended
            return self._pidfd is not None and not readable(self._pidfd, 0)

    def wait_ready(self, deadline_s: float) -> None:
        """Block until the process serves (at once after a fork; seconds after a new interpreter's start,
        where the wait lands where the caller chooses, the rank's setup, rather than in its first saves:
        there a save waiting for the one before it can outlast NVRx's checkpoint section timeout)."""
        self._exchange(lambda: None, deadline_s)

    def write(self, request: WriteRequest, deadline_s: float) -> list[WriteResult]:
        """Write one rank's shards (blocks the calling thread, not the CPU); raises what the write raised, or
        WriterTimedOut when no answer came within `deadline_s`."""
        def send_and_receive() -> list[WriteResult] | BaseException:
            self._channel.send(request)
            return self._channel.recv(deadline_s)

        answer = self._exchange(send_and_receive, deadline_s)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def _exchange(self, talk: Callable[[], T], deadline_s: float) -> T:
        try:
            with self._one_write:
                if not self._ready:
                    self._channel.recv(deadline_s)
                    self._ready = True
                return talk()
        except TimeoutError:
            self.failure = f"no answer within {deadline_s:g} s"
            ended = self._kill()
            self.close()  # an answer that comes after all reaches nobody
            log.error("checkpoint writer process %d gave no answer within %g s (stuck in I/O?): its save fails; it "
                      "was SIGKILLed (%s) and is abandoned; the next save starts a new one", self.pid, deadline_s,
                      "ended" if ended else f"still not ended after {_KILL_GRACE_S:g} s")
            raise WriterTimedOut(f"checkpoint writer process {self.pid} gave no answer within {deadline_s:g} s "
                                 "(stuck in I/O?): killed and abandoned") from None
        except (EOFError, OSError) as err:
            raise WriterProcessDied(f"checkpoint writer process {self.pid} died") from err

    def _kill(self) -> bool:
        """SIGKILL it; whether it ended within _KILL_GRACE_S (True if it is closed already)."""
        with self._life:
            return self._pidfd is None or _kill_and_wait(self._pidfd, _KILL_GRACE_S)

    def abort(self) -> None:
        """The iteration dies: kill the process whatever it is doing (a save thread waiting on it gets
        WriterProcessDied), waiting a few seconds at most, and close the handle. Its `.tmp-` directory stays
        uncommitted (only the training process commits) and is removed by the next manager."""
        if not self._kill():
            log.error("checkpoint writer process %d did not end within %g s of SIGKILL (uninterruptible I/O?): "
                      "abandoned; its save stays uncommitted, and the next save starts a new writer",
                      self.pid, _KILL_GRACE_S)
        self.close()

    def close(self) -> None:
        """Release the handle (its pidfd and socket; a writer that outlives it gets EOF and leaves)."""
        with self._life:
            if self._pidfd is not None:
                os.close(self._pidfd)
                self._pidfd = None
        self._channel.close()


_zygote: _Zygote | None = None
_shared: WriterProcess | None = None


def start_zygote() -> None:
    """Fork this process's writer zygote now: call it where the process has no thread but its main one
    (training.train's main, before the run; the rank is a fork of the prefork template, or an interpreter
    that imported torch). Elsewhere the first save spawns one instead (seconds)."""
    global _zygote
    if _zygote is None:
        _zygote = _Zygote.start()


def shared_writer_process(deadline_s: float, report: Callable[[Replaced], None]) -> WriterProcess:
    """This process's writer process, running: one per process, not one per CheckpointManager, kept while
    it runs (a test's next manager, a clean close); after an abort, its death or a timeout, the zygote forks
    another. A writer abandoned after a timeout, and a zygote found dead or stuck, are `report`ed as replaced."""
    global _shared
    if _shared is not None and _shared.running:
        return _shared
    old, _shared = _shared, None
    if old is not None:
        old.close()
    _shared = _new_writer(deadline_s, report)
    if old is not None and old.failure is not None:
        report(Replaced("writer", old.pid, _shared.pid, old.failure))
    return _shared


def _new_writer(deadline_s: float, report: Callable[[Replaced], None]) -> WriterProcess:
    """A writer forked by the zygote; a zygote that does not answer is replaced, and asked once more."""
    global _zygote
    if _zygote is None:
        _zygote = _Zygote.spawn()
    try:
        return _zygote.new_writer(deadline_s)
    except ZygoteLost as err:
        lost = _zygote
        lost.close()
        _zygote = _Zygote.start()  # in a training process with threads: a new interpreter (seconds)
        log.error("%s; a new zygote (%d) takes its place", err, _zygote.pid)
        report(Replaced("zygote", lost.pid, _zygote.pid, str(err)))
        return _zygote.new_writer(deadline_s)


def _forget_the_parents_writer() -> None:
    """In a forked child: the parent's zygote and writer are the parent's (their sockets would mix both
    processes' requests). os.fork runs this hook also where multiprocessing's own are not run
    (training.pod.prefork)."""
    global _shared, _zygote
    _shared = _zygote = None


os.register_at_fork(after_in_child=_forget_the_parents_writer)


def _writer_main(fd: int) -> None:
    # Serialising and writing need no intra-op parallelism; torch's default (a thread per CPU) would
    # spin threads on the CPUs the training ranks use.
    torch.set_num_threads(1)
    # The zip checksum torch.save computes over every byte is two thirds of this process's CPU time per
    # save, and torch.load never checks it (a flipped data byte loads silently, tried with torch 2.13);
    # `inspection`'s evidence of damage (missing, short files) does not use it. set_crc32_options (torch docs,
    # "Serialization semantics") turns it off for this process only.
    torch.serialization.set_crc32_options(False)
    raise_fd_limit()  # it receives two descriptors per staging buffer at once (shm_budget)
    channel = ShmChannel(socket.socket(fileno=fd))
    channel.send(None)  # ready
    _serve(channel)


def _main(fd: int) -> None:
    """A zygote started as a new interpreter (`_Zygote.spawn`)."""
    _die_with_parent()
    _zygote_loop(socket.socket(fileno=fd))


if __name__ == "__main__":
    _main(int(sys.argv[1]))
