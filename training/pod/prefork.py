"""Pre-forked workers: an in-job restart without Python start-up and imports.

ft_launcher starts each worker as a fresh `python -m training.train`, so every in-job restart pays for
the interpreter and the imports of torch, DCP/DTensor, torch._dynamo and NVRx, on all ranks of a node at
once. Here one template process per node imports all that once and forks a pristine worker (nothing run:
no tensor, no CUDA context, no process group) for each start ft_launcher asks for; `launch` forks the
template and runs ft_launcher, `worker` is the stdlib-only stub ft_launcher runs in its place. Cost: a
template process per node, and what torch's and NVRx's imports read once (environment, rlimits) comes from
the template. The protocol and every difference from a plain worker are in docs/recovery.md, "Pre-forked
workers".
"""
from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import struct
import sys
import time
from typing import NoReturn

SERVER_ENV = "TRAINING_PREFORK_SERVER"  # "<template pid>:<abstract socket name>", set by `launch`
# What a training worker imports before its first step. torch._dynamo is imported lazily by
# FSDP2's first fully_shard call; NVRx's client by training.contract.launcher.RankMonitor.
PRELOAD = ("training.train.trainer", "torch._dynamo", "nvidia_resiliency_ext.fault_tolerance")
READY_TIMEOUT_S = 300.0  # a stub waits this long for a template that is still importing
REQUEST_TIMEOUT_S = 30.0  # for a request to arrive, and for the worker's PID to come back
MAX_REQUEST_BYTES = 1 << 20  # argv, environment and working directory, as JSON
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
                     signal.SIGUSR2)


def die_with_parent(sig: signal.Signals) -> None:
    """Have the kernel send `sig` to this process when its parent dies, even by SIGKILL (Linux)."""
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig)


def launch(command: list[str]) -> NoReturn:
    """Fork the template, then become `command`. A console script of this interpreter's distributions
    (ft_launcher) runs in this process, its module imported before the fork: the template inherits
    torch with it and imports only what the workers add, one torch import per node instead of two. Any
    other command is exec'd."""
    import secrets

    from training.pod import rendezvous_names
    from training.pod.forked import console_script

    script = console_script(command[0])
    main = script.load() if script is not None else None
    if main is not None:
        rendezvous_names.install()  # ft_launcher's rendezvous rounds, on the path of every restart
    # unguessable and unique per launch: pods that share a network namespace (hostNetwork) all run
    # ft_launcher as PID 1
    name = f"training-prefork-{secrets.token_hex(16)}"
    launcher = os.getpid()
    template = os.fork()
    if template == 0:
        try:
            devnull = os.open(os.devnull, os.O_RDONLY)
            os.dup2(devnull, 0)
            os.close(devnull)
            serve(name, launcher)
            os._exit(0)
        except BaseException:  # noqa: BLE001 - as a fresh interpreter would: print it, exit 1
            import traceback

            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
    os.environ[SERVER_ENV] = f"{template}:{name}"
    if main is None:
        os.execvp(command[0], command)
    sys.argv = command
    sys.exit(main())


def serve(name: str, launcher: int) -> None:
    """The template: import PRELOAD, then fork a supervised worker per stub that connects."""
    die_with_parent(signal.SIGTERM)
    if os.getppid() != launcher:  # the launcher died before the line above
        return
    # nothing to flush; the interpreter's exit would run the imports' atexit hooks
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    # An abstract socket: no file to leave behind when the template is killed. Bound at once, so
    # that nobody else can take the name; stubs connect only once it listens, after the imports.
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(_address(name))
    started = time.monotonic()
    preload()
    listener.listen(64)
    print(f"training.pod.prefork: worker template ready ({time.monotonic() - started:.1f} s of imports)",
          file=sys.stderr, flush=True)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # supervisors are reaped by the kernel
    while True:
        conn, _ = listener.accept()
        try:
            _check_peer(conn, pid=None)
            conn.settimeout(REQUEST_TIMEOUT_S)  # a silent client must not hold up every other start
            request, fds, _, _ = socket.recv_fds(conn, MAX_REQUEST_BYTES, 3)
            conn.settimeout(None)
        except OSError:  # a stub that went away mid-request, a silent one, or another user's process
            conn.close()
            continue
        if os.fork() == 0:
            try:
                listener.close()
                _supervise(conn, json.loads(request), fds)
            finally:
                os._exit(1)  # only reached on an error: never return into the accept loop
        conn.close()
        for fd in fds:
            os.close(fd)


def _address(name: str) -> str:
    return "\0" + name  # Linux abstract namespace


def _check_peer(conn: socket.socket, pid: int | None) -> None:
    """Anyone in the network namespace can reach an abstract socket: deal only with our own user
    and, in the stub, only with the template named in SERVER_ENV."""
    peer_pid, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                           struct.calcsize("3i")))
    if uid != os.getuid() or (pid is not None and peer_pid != pid):
        raise PermissionError(f"peer pid {peer_pid}, uid {uid}")


def preload() -> None:
    """Import PRELOAD as the template does, ready to fork: no CUDA context, the imports frozen."""
    import gc
    import importlib

    # A CUDA context cannot survive a fork: should an import ask whether CUDA is available, let
    # it ask NVML rather than initialise the driver.
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    for name in PRELOAD:
        importlib.import_module(name)
    import torch

    if torch.cuda.is_initialized():
        raise RuntimeError("CUDA was initialised while importing; workers forked from here could not use it")
    # The imports' ~300k objects live as long as the worker: frozen, a full collection skips them. NVRx's
    # Wrapper collects until nothing is freed at every in-process restart (0.7.0 inprocess/wrap.py; two passes
    # of ~0.1 s each otherwise), and fewer pages are written after the fork. Python's gc.freeze docs recommend
    # it before fork.
    gc.freeze()


def _supervise(conn: socket.socket, request: dict, fds: list[int]) -> NoReturn:
    """Fork the worker, tell the stub its PID, and report its exit status; kill it if the stub dies."""
    import select

    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # waitpid needs it
    for sig in (signal.SIGTERM, signal.SIGINT):  # only the stub's end of `conn` ends a supervisor
        signal.signal(sig, signal.SIG_IGN)
    supervisor = os.getpid()
    ready_r, ready_w = os.pipe()
    worker = os.fork()
    if worker == 0:
        try:
            conn.close()
            os.close(ready_r)
            _become_worker(request, fds, supervisor, ready_w)
        finally:
            os._exit(1)
    for fd in (*fds, ready_w):
        os.close(fd)
    # The PID goes out once the worker leads its process group with default signal handlers:
    # a stop signalled to it earlier would be lost.
    os.read(ready_r, 1)  # b"" if it died first: waitpid below reports that
    os.close(ready_r)
    conn.sendall(json.dumps({"pid": worker}).encode())
    pidfd = os.pidfd_open(worker)
    ready, _, _ = select.select([conn, pidfd], [], [])
    if pidfd not in ready:  # the stub is gone (killed): so goes its worker
        _kill_group(worker, signal.SIGKILL)
    _, status = os.waitpid(worker, 0)
    # What the worker started and left behind (multiprocessing helpers, an async checkpoint
    # process), as NVRx 0.7.0's launcher kills its workers' process groups.
    _kill_group(worker, signal.SIGKILL)
    with contextlib.suppress(OSError):  # the stub may be gone
        conn.sendall(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode())
    os._exit(0)


def _become_worker(request: dict, fds: list[int], supervisor: int, ready: int) -> NoReturn:
    """In the forked worker: take the stub's session role, stdio, cwd, environment, umask, CPU
    affinity and argv, then run the module as `python -m` would, and exit with its status."""
    from training.pod.forked import run_here

    os.setsid()
    die_with_parent(signal.SIGKILL)
    if os.getppid() != supervisor:
        os._exit(1)
    for sig in FORWARDED_SIGNALS:
        signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    os.write(ready, b"1")
    os.close(ready)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    os.umask(request["umask"])
    os.sched_setaffinity(0, request["cpus"])  # e.g. a NUMA binding the launcher gave the stub
    module = request["module"]
    run_here(module, [sys.executable, "-m", module, *request["args"]], request["cwd"], request["env"])


def worker(module: str, args: list[str]) -> NoReturn:
    """The stub: run `module` in a worker forked from the template, or exec it without one."""
    server = os.environ.get(SERVER_ENV)
    conn = _connect(server) if server else None
    pid = _request_fork(conn, module, args) if conn is not None else None
    if pid is None:
        if server:
            print(f"training.pod.prefork: no worker template ({SERVER_ENV}={server}); starting a fresh Python",
                  file=sys.stderr, flush=True)
        os.execv(sys.executable, [sys.executable, "-m", module, *args])

    def forward(sig: int, _frame: object) -> None:
        _kill_group(pid, sig)

    for sig in FORWARDED_SIGNALS:
        signal.signal(sig, forward)
    reply = conn.recv(4096)
    if not reply:  # the supervisor died without a word: make sure the worker is gone too
        forward(signal.SIGKILL, None)
        sys.exit(1)
    code = json.loads(reply)["exit"]
    if code < 0:  # killed by a signal: die by it too, so ft_launcher reports the same
        with contextlib.suppress(OSError):  # SIGKILL has no handler to reset
            signal.signal(-code, signal.SIG_DFL)  # Python ignores SIGPIPE, and forwards others here
        os.kill(os.getpid(), -code)
    sys.exit(code)


def _kill_group(worker: int, sig: int) -> None:
    """Signal the worker's process group (it leads one, in its own session), its children included."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(worker, sig)


def _connect(server: str) -> socket.socket | None:
    """Connect to the template, waiting while it imports; None once it is gone."""
    pid, _, name = server.partition(":")
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            conn.connect(_address(name))
            _check_peer(conn, int(pid) if pid.isdigit() else -1)
            return conn
        except ConnectionRefusedError:  # not listening yet
            conn.close()
        except PermissionError as err:  # not our template
            print(f"training.pod.prefork: refusing the worker template's address: {err}", file=sys.stderr, flush=True)
            conn.close()
            return None
        if not pid.isdigit() or not _running(int(pid)) or time.monotonic() > deadline:
            return None
        time.sleep(0.05)


def _request_fork(conn: socket.socket, module: str, args: list[str]) -> int | None:
    """The worker's PID, or None when the template refused (it closed the connection)."""
    request = {"module": module, "args": args, "env": dict(os.environ), "cwd": os.getcwd(), "umask": _umask(),
               "cpus": sorted(os.sched_getaffinity(0))}
    try:
        conn.settimeout(REQUEST_TIMEOUT_S)
        socket.send_fds(conn, [json.dumps(request).encode()], [0, 1, 2])
        reply = conn.recv(4096)
        conn.settimeout(None)  # the worker may run for days
    except OSError:  # includes the timeout; closing the connection makes its supervisor kill a late worker
        return None
    return json.loads(reply)["pid"] if reply else None


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _running(pid: int) -> bool:
    """Alive and not a zombie (a dead template stays a zombie: ft_launcher does not reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, IndexError):
        return False


def main(argv: list[str]) -> None:
    usage = "usage: python -m training.pod.prefork {launch CMD [ARG ...] | worker MODULE [ARG ...]}"
    if len(argv) < 2 or argv[0] not in ("launch", "worker"):
        sys.exit(usage)
    if argv[0] == "launch":
        launch(argv[1:])
    else:
        worker(argv[1], argv[2:])


if __name__ == "__main__":
    main(sys.argv[1:])
