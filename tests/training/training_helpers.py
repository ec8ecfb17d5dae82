"""Helpers for the training tests: run the local emulated cluster as a subprocess, read its results."""
from __future__ import annotations

import errno
import fcntl
import functools
import gc
import json
import logging
import multiprocessing
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, TypeVar

import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from training.contract.config import CheckpointConfig
from training.contract.events import read_events
from training.contract.launcher import free_port
from training.local.cluster import POD_MODULES, POD_SCRIPTS, pod_import_env
from training.local.shape import ClusterShape
from training.pod import forked
from training.pod.forked import FORK_ENV
from training.train import trainer
from training.train.checkpoint.manager import CheckpointManager
from training.train.final_state import bitwise_mismatch, load_final_state  # load_final_state: for the tests

REPO_ROOT = Path(__file__).resolve().parents[2]

# The fault runs' common shape (tests/training/conftest.py's `reference` is their uninterrupted run).
STEPS, INTERVAL, COLLECTIVE_TIMEOUT_S, RANKS, GLOBAL_BATCH = 20, 5, 30, 2, 8
COMMON = ("--steps", str(STEPS), f"checkpoint.interval={INTERVAL}", "checkpoint.save_final=true",
          "logging.log_interval=10", f"training.collective_timeout_s={COLLECTIVE_TIMEOUT_S}",
          # each of the 2 ranks accumulates 2 micro-batches of 2 (training.global_batch_size): every exact
          # resume below covers gradient accumulation, with FSDP2's reduce after the last micro-batch only
          "training.batch_size=2", f"training.global_batch_size={GLOBAL_BATCH}",
          # calculated hang timeouts stay loose on a loaded 2-core box (max observed x 50)
          "fault_tolerance.timeout_safety_factor=50")
# Both shapes have world size RANKS (2) with the same shards: one uninterrupted run is the reference of all.
# A test that needs spares or another replacement delay starts from one of them (dataclasses.replace).
ONE_NODE = ClusterShape(nodes=1, nproc_per_node=2)
TWO_NODES = ClusterShape(nodes=2, nproc_per_node=1)


@dataclass
class LocalRun:
    run_dir: Path
    returncode: int
    output: str


def exit_code(main: Callable[[list[str]], int], argv: list[str]) -> int:
    """A CLI's exit code, in process: what `main` returns, or the code it exits with (a refused config)."""
    try:
        return main(argv)
    except SystemExit as exited:
        return int(exited.code or 0)


def run_local(run_dir: Path, *args: str, timeout: float = 240, env: dict[str, str] | None = None) -> LocalRun:
    """`python -m training.local --run-dir RUN_DIR ARGS…`, to completion; `env` adds variables."""
    run = start_local(run_dir, *args, env=env)
    try:
        output, _ = run.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        run.kill()
        run.wait()
        raise
    return LocalRun(run_dir, run.returncode, output)


def start_local(run_dir: Path, *args: str, env: dict[str, str] | None = None) -> StartedRun:
    """`python -m training.local --run-dir RUN_DIR ARGS…`, started; `env` adds variables. The controller is
    forked from `_controllers`, and it forks its pods and store in turn (training.pod.forked)."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), FORK_ENV: "1", **(env or {})}
    command = [sys.executable, "-m", "training.local", "--run-dir", str(run_dir), *args]
    # not beside the run directory: a test may fill that file system
    output = Path(tempfile.mkdtemp(prefix=f"{run_dir.name}-controller-")) / "output"
    controller = _controllers().Process(target=_controller, args=(command, env, str(output)))
    controller.start()
    return StartedRun(controller, output)


class StartedRun:
    """A controller started by `start_local`, with what the tests use of subprocess.Popen; its output is its
    standard output and error in one."""

    def __init__(self, controller: multiprocessing.process.BaseProcess, output: Path) -> None:
        self.controller, self.output = controller, output
        self.pid = controller.pid

    @property
    def returncode(self) -> int | None:
        return self.controller.exitcode

    def poll(self) -> int | None:
        return self.controller.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self.controller.join(timeout)
        if self.controller.exitcode is None:
            raise subprocess.TimeoutExpired(f"training.local {self.output.parent}", timeout or 0.0)
        return self.controller.exitcode

    def communicate(self, timeout: float | None = None) -> tuple[str, None]:
        """Its output, once it exited (subprocess.TimeoutExpired after `timeout`); the output so far where it
        is still running when the run failed (a test's assertion message)."""
        if self.controller.exitcode is None and timeout is not None:
            self.wait(timeout)
        text = self.output.read_text(errors="replace") if self.output.exists() else ""
        if self.controller.exitcode is not None:
            shutil.rmtree(self.output.parent, ignore_errors=True)
        return text, None

    def send_signal(self, sig: int) -> None:
        if self.controller.exitcode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


# Imported before the fork server's first fork: the controller's, the pods' and the store's modules.
CONTROLLER_PRELOAD = ("training.local.cli", *POD_MODULES,
                      *(script.module for name in POD_SCRIPTS if (script := forked.console_script(name)) is not None))
# What a pod's imports read, as the cluster sets it for its pods under any restart mode (both: all of it).
CONTROLLER_IMPORT_ENV = pod_import_env("both")


@functools.cache
def _controllers() -> multiprocessing.context.ForkServerContext:
    """A fork server (multiprocessing's) of this test process: a fresh interpreter that imported
    CONTROLLER_PRELOAD in CONTROLLER_IMPORT_ENV, and forks each controller of `run_local`. Forked from the
    test process instead, a controller would inherit pytest's threads and exit functions."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(CONTROLLER_PRELOAD))
    saved = {key: os.environ.get(key) for key in CONTROLLER_IMPORT_ENV}
    os.environ.update(CONTROLLER_IMPORT_ENV)
    try:
        from multiprocessing import forkserver

        forkserver.ensure_running()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return context


def _controller(command: list[str], env: dict[str, str], output: str) -> None:
    """In a child of the fork server: `command` (`python -m training.local …`), its output in `output`."""
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    opened = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(opened, 1)
    os.dup2(opened, 2)
    os.close(opened)
    forked.reset_signals()
    forked.run_here("training.local", command, str(REPO_ROOT), env)


def run_forked(run_dir: Path, world: int, *args: str, timeout: float = 240) -> LocalRun:
    """The run that `run_local(run_dir, <world ranks>, *args)` makes when nothing fails, by `world` ranks
    forked from this process (`fork_ranks`): no launcher, store or controller, which an uninterrupted run does
    not use. `args` are config overrides and `--steps N`; the output is the ranks', rank 0's first."""
    overrides = list(args)
    if "--steps" in overrides:
        at = overrides.index("--steps")
        overrides[at:at + 2] = [f"training.steps={overrides[at + 1]}"]
    logs = Path(tempfile.mkdtemp(prefix=f"{run_dir.name}-logs-", dir=run_dir.parent))  # this run's alone
    ranks = fork_ranks(lambda _: trainer.main([f"run_dir={run_dir}", *overrides]), logs, world=world, timeout=timeout)
    failed = next((r.code for r in ranks if r.code != 0), 0)
    return LocalRun(run_dir, failed, "".join(r.output for r in ranks))


def wait_for_step(run_dir: Path, step: int, proc: StartedRun, timeout: float = 90) -> None:
    """Until rank 0 logged `step` (the run failing or `timeout` fails the test)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        try:
            if any(e["event"] == "step" and e["step"] >= step for e in read_events(run_dir)):
                return
        except FileNotFoundError:
            pass
        time.sleep(0.3)
    proc.kill()
    pytest.fail(f"no step {step} within {timeout} s: {proc.communicate()[0][-3000:]}")


T = TypeVar("T")


def once_per_session(factory: pytest.TempPathFactory, name: str, make: Callable[[Path], T]) -> T:
    """`make(path)` (a path of its own, not there yet) once per test session, shared by its xdist workers: the
    first to ask makes it, the others wait for it (a file lock) and get what it returned (pickled). For the runs
    several tests check; a test that changes a shared run's files copies them first. What failed is made again
    by the next to ask. The xdist docs' recipe ("Making session-scoped fixtures execute only once"): the
    workers' temporary folders share a parent."""
    root = factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    shared = root / "once" / name
    shared.mkdir(parents=True, exist_ok=True)
    with (shared / "lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        made = shared / "made.pickle"
        if not made.exists():
            shutil.rmtree(shared / "made", ignore_errors=True)  # what a failed try left
            made.write_bytes(pickle.dumps(make(shared / "made")))
        return pickle.loads(made.read_bytes())


def completed(run: LocalRun) -> LocalRun:
    """`run`, asserted to have exited 0 (the tail of its output as the message)."""
    assert run.returncode == 0, run.output[-4000:]
    return run


def as_a_forked_rank() -> None:
    """First call in a child forked from the test process, before it trains: the parent's OpenMP pool is not in
    the child (libgomp hangs at the first parallel op), and the parent's garbage (process groups, stores: C++
    objects owning threads that the child does not have) must not be collected here, where their destructors
    abort on a thread that is not there. Collect in the parent before forking (`gc.collect()`) too."""
    import torch

    torch.set_num_threads(1)
    gc.freeze()


def fork_rank(body: Callable[[], object], log: Path, env: dict[str, str]) -> int:
    """`body()` in a child forked from the test process (torch imported once), with `env` added and its stdout
    and stderr in `log`; the child's pid. It exits with `body`'s int result, 0 for any other, 3 if it raised."""
    gc.collect()  # the test process's garbage dies here, not in the child
    pid = os.fork()
    if pid:
        return pid
    code = 3
    try:
        as_a_forked_rank()
        out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(out, 1)
        os.dup2(out, 2)
        sys.stdout = sys.stderr = open(1, "w", buffering=1, closefd=False)  # not pytest's capture
        logging.root.handlers.clear()  # pytest's too: a rank's logging.basicConfig then writes to its log
        os.environ.update(env)
        result = body()
        code = result if isinstance(result, int) else 0
    except BaseException:  # noqa: BLE001 - the child reports every failure in its log and exit code
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        os._exit(code)


def reap(pids: list[int], timeout: float) -> dict[int, int]:
    """pid -> exit code (minus the signal that ended it) of each of `pids` that exits within `timeout`; those
    still running then are SIGKILLed and left out. A forked child can block for good (a lock another thread
    of the test process held at the fork), so no test waits for one without a deadline."""
    codes: dict[int, int] = {}
    deadline = time.monotonic() + timeout
    while len(codes) < len(pids) and time.monotonic() < deadline:
        for pid in (p for p in pids if p not in codes):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes[pid] = os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    for pid in (p for p in pids if p not in codes):
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    return codes


@dataclass(frozen=True)
class ForkedRank:
    code: int  # its exit code: 3 if its body raised; minus the signal that killed it
    output: str


def fork_ranks(body: Callable[[int], object], logs: Path, world: int = 2, timeout: float = 90) -> list[ForkedRank]:
    """`body(rank)` as ranks 0..world-1 of one world (RANK, WORLD_SIZE, their LOCAL_ twins, MASTER_ADDR and a
    fresh MASTER_PORT set), each forked by `fork_rank`, to completion; after `timeout` the test fails with
    their outputs (one file per rank under `logs`)."""
    logs.mkdir(parents=True, exist_ok=True)
    port = str(free_port())
    env = {"WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    pids = [fork_rank(lambda rank=rank: body(rank), logs / f"rank{rank}.log",
                      {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}) for rank in range(world)]
    codes = reap(pids, timeout)
    outputs = [(logs / f"rank{rank}.log").read_text() if (logs / f"rank{rank}.log").exists() else ""
               for rank in range(world)]
    if len(codes) < world:
        pytest.fail(f"ranks still running after {timeout} s; their outputs: {outputs}")
    return [ForkedRank(codes[pid], output) for pid, output in zip(pids, outputs)]


def completed_ranks(ranks: list[ForkedRank]) -> list[str]:
    """The outputs of `ranks`, asserted to have exited 0."""
    assert [r.code for r in ranks] == [0] * len(ranks), [r.output[-3000:] for r in ranks]
    return [r.output for r in ranks]


def rank_results(body: Callable[[int], object], logs: Path, world: int = 2, timeout: float = 90) -> list[object]:
    """What `body(rank)` returned on each of the `world` ranks of `fork_ranks`, in rank order (each rank pickles
    its value into `logs`), every rank asserted to have exited 0."""
    def returning(rank: int) -> None:
        (logs / f"rank{rank}.result").write_bytes(pickle.dumps(body(rank)))

    completed_ranks(fork_ranks(returning, logs, world, timeout))
    return [pickle.loads((logs / f"rank{rank}.result").read_bytes()) for rank in range(world)]


def checkpoint_manager(directory: str | os.PathLike, **kw: Any) -> CheckpointManager:
    """The CheckpointManager of the checkpoints in `directory`, its run's directory the parent. `kw`: keys of
    the checkpoint section (mode, keep, interval, when_busy, save_final, also_resume_from) and the manager's
    other arguments (events, write_hook, deadlines, around_save, device)."""
    keys = {f.name for f in fields(CheckpointConfig)}
    section = CheckpointConfig(dir=str(directory), **{k: v for k, v in kw.items() if k in keys})
    return CheckpointManager(section, Path(directory).parent, **{k: v for k, v in kw.items() if k not in keys})


def samples_by_step(run_dir: Path) -> dict[int, list[int]]:
    """Step -> the sample indices every rank logged for it (logging.sample_log), a replayed step's as often as
    it ran."""
    held: dict[int, list[int]] = {}
    for path in sorted((run_dir / "samples").glob("rank*.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            held.setdefault(record["step"], []).extend(record["indices"])
    return held


def assert_bitwise_equal(a: dict, b: dict) -> None:
    mismatch = bitwise_mismatch(a, b)
    assert mismatch is None, mismatch


def events_named(run_dir: Path, name: str) -> list[dict]:
    """The run's events of one kind (training.contract.events), in time order."""
    return [e for e in read_events(run_dir) if e["event"] == name]


Metrics = dict[tuple[str, tuple], float]  # (name, sorted labels) -> value


def scrape(port: int) -> Metrics:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def scrape_when(port: int, ready, timeout: float = 60) -> Metrics:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            metrics = scrape(port)
            if ready(metrics):
                return metrics
        except OSError:  # not bound yet, or between the old rank 0 and the new
            pass
        time.sleep(0.3)
    pytest.fail(f"no scrape of port {port} met the condition within {timeout} s")


@dataclass
class StoppedRun:
    run_dir: Path
    returncode: int
    output: str
    metrics: Metrics  # rank 0's endpoint, scraped once step SCRAPED_STEP was reached
    tree: list[psutil.Process]  # every process the controller had started, just before Ctrl-C


SCRAPED_STEP = 25


def run_stopped_by_ctrl_c(run_dir: Path) -> StoppedRun:
    """2 nodes x 1 rank with rank 0's metrics endpoint, no end in sight: rank 1 fails at step 15 (ft_launcher
    restarts the whole group, and the new rank 0 binds the port again); once step SCRAPED_STEP is reached, the
    endpoint is scraped once two checkpoints are committed, the process tree noted, and the controller gets
    SIGINT (Ctrl-C)."""
    port = free_port()
    proc = start_local(run_dir, *TWO_NODES.argv(), "--steps", "100000",
                       "--faults", "exception@15:rank=1", f"metrics.port={port}", "metrics.event_log_refresh_s=0",
                       "checkpoint.interval=10", "fault_tolerance.timeout_safety_factor=50")
    try:
        wait_for_step(run_dir, SCRAPED_STEP, proc)
        # and the async save of step 20 committed: on a loaded machine its commit can lag SCRAPED_STEP
        metrics = scrape_when(port, lambda m: m.get(("training_step", ()), 0) >= SCRAPED_STEP
                              and m.get(("training_checkpoints_committed", ()), 0) >= 2)
        tree = psutil.Process(proc.pid).children(recursive=True)
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    return StoppedRun(run_dir, proc.returncode, out, metrics, tree)


class SmallFileSystem:
    """A real file system of `size` bytes at `path` (a tmpfs: mounting it needs root, as here and in CI) that a
    test fills, so that writes fail with ENOSPC as on a full FSx, and frees again."""

    PAGE = 4096  # tmpfs allocates its space in pages

    def __init__(self, path: Path, size: int) -> None:
        path.mkdir(parents=True, exist_ok=True)
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                                 capture_output=True, text=True)
        if mounted.returncode != 0:
            pytest.skip(f"a full file system needs a tmpfs mount (root): {mounted.stderr.strip()}")
        self.path = path
        self._filler = path / ".filler"
        self._stop_filling = threading.Event()
        self._filling: threading.Thread | None = None

    def fill(self, leave_pages: int = 0) -> None:
        """Take every free page but `leave_pages`: the next writes beyond those fail with ENOSPC."""
        fd = os.open(self._filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            for chunk in (1 << 20, self.PAGE):
                try:
                    while os.write(fd, bytes(chunk)) == chunk:
                        pass
                except OSError as err:
                    if err.errno != errno.ENOSPC:
                        raise
        finally:
            os.close(fd)
        pages = -(-self._filler.stat().st_size // self.PAGE)
        os.truncate(self._filler, max(0, pages - leave_pages) * self.PAGE)

    def keep_full(self) -> None:
        """Fill it now, and again every few milliseconds until `free`, as other writers of a shared file system
        would: what a failed save's clean-up frees is taken at once."""
        self.fill()
        self._stop_filling.clear()
        self._filling = threading.Thread(target=self._top_up, daemon=True)
        self._filling.start()

    def _top_up(self) -> None:
        while not self._stop_filling.wait(0.005):
            self.fill()

    def free(self) -> None:
        """Stop the top-ups, then free every page: a top-up still under way (however long a loaded machine
        makes it) would otherwise hold its pages, or make the filler again, after this returns."""
        if self._filling is not None:
            self._stop_filling.set()
            self._filling.join()
            self._filling = None
        self._filler.unlink(missing_ok=True)

    def unmount(self) -> None:
        self.free()  # a top-up after the unmount would fill the disk beneath
        subprocess.run(["umount", "--lazy", str(self.path)], check=True)  # lazy: a process may still hold a file
