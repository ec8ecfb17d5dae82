"""Checkpoint stall: how long a save blocks training, sync vs async, and what that costs in step rate and CPU.

The same state is trained on with checkpoints off, sync and async, each mode through its own
CheckpointManager, run directory and event log; each save's blocking is read from its log through
training.report. measure_stall runs on CPU: a synthetic state, the modes in interleaved rounds, at an
interval calibrated so that sync saves take CALIBRATED_SYNC_COST of the time (the reference's ~60%
efficiency); it also charges each save's CPU time to the training rank and to the async writer process.
measure_stall_on_cluster runs on a GPU: three real training runs of a model preset on one local-cluster
node. StallResult says what each figure is.
"""
from __future__ import annotations

import math
import os
import shutil
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.cluster import ClusterSpec, run_cluster
from training.contract.config import CheckpointConfig
from training.contract.events import EventLog
from training.contract.launcher import free_port
from training.local.shape import ClusterShape
from training.report.goodput import report_run
from training.train.checkpoint.manager import CheckpointManager
from training.train.distributed import init_distributed, teardown

MODES = ("off", "sync", "async")
WRITER = "writer"  # the async writer process, in the per-round CPU times
CHUNK_BYTES = 64 << 20  # state tensors of at most 64 MiB, like a model's parameters
CALIBRATED_SYNC_COST = 0.4  # share of the run a sync save should take at the calibrated interval
MIN_INTERVAL, MAX_INTERVAL = 5, 100  # at least a few steps between saves, at most a few minutes a pass
CALIBRATION_STEPS = 5


@dataclass(frozen=True)
class StallSpec:
    state_bytes: int
    world: int
    saves: int  # saves inside the measured window
    matmuls_per_step: int
    device: str = "cpu"


@dataclass(frozen=True)
class StallResult:
    """The figures of one stall measurement. Blocking per save: the saves' ckpt_blocked (async: the save's start,
    and the wait for its staging copy before the next update). Step wall time: a mode's rounds' wall time / its
    steps (CPU), or from the end of the first step to the end of the last, per step (GPU): steps, blocking and
    any slowdown from a background write together. Efficiency: step wall time without checkpoints / with them.
    CPU time per save (CPU only; medians over the rounds, means over the ranks), charged to whom it costs: the
    training rank, its process's CPU time in a round (every thread: for async, the staging and the background
    thread's planning and coordination) less what it spent in the same round with checkpoints off; and the
    async writer process, its CPU time in the round (the shard write: serialisation, the write around the page
    cache, fsync). A sync save has no writer: the rank writes. A background write hides its wait, not its CPU
    time: where the ranks keep every CPU busy, the writer's time comes out of training."""
    state_bytes: int  # measured: the size of the committed sync checkpoint
    world_size: int
    interval_steps: int
    steps: int
    sync_blocking_s: float
    async_blocking_s: float
    sync_blocking_per_save_s: tuple[float, ...]
    async_blocking_per_save_s: tuple[float, ...]
    blocking_ratio: float  # async / sync
    step_wall_off_s: float
    step_wall_sync_s: float
    step_wall_async_s: float
    efficiency_sync: float
    efficiency_async: float
    run_dirs: dict[str, str]
    cpu_per_save_sync_s: float | None = None  # CPU only: the training rank's
    cpu_per_save_async_s: float | None = None
    writer_cpu_per_save_async_s: float | None = None  # the async writer process's
    # CPU only: the async writer's one-time start, as a rank's start makes it (its process forked, its staging
    # buffers allocated), before the first round; counted in no mode
    async_setup_s: float | None = None

    @property
    def rank_cpu_ratio(self) -> float | None:
        """CPU time an async save charges the training rank / a sync save's."""
        if self.cpu_per_save_async_s is None or not self.cpu_per_save_sync_s:
            return None
        return self.cpu_per_save_async_s / self.cpu_per_save_sync_s


def step_wall_s(run_dir: Path) -> float:
    """Wall time per step over the run's steps, blocking and slowdown included."""
    timeline, _ = report_run(run_dir)
    ends = sorted(r.end_s for r in timeline.runs)
    return (ends[-1] - ends[0]) / (len(ends) - 1)


def blocking_per_save(run_dir: Path) -> tuple[float, ...]:
    timeline, _ = report_run(run_dir)
    return tuple(s.end_s - s.start_s for s in timeline.saves)


def analyse(run_dirs: dict[str, Path], walls: dict[str, float], state_bytes: int, world: int, interval: int,
            steps: int, cpu_per_round: dict[str, list[float]] | None = None,
            writer_cpu_per_round: list[float] | None = None, async_setup_s: float | None = None) -> StallResult:
    """`walls`: wall time per step of each mode; `cpu_per_round`: a rank's CPU time in each round of each
    mode, `writer_cpu_per_round`: its async writer process's in each async round (means over ranks)."""
    def cpu_per_save(mode: str) -> float | None:
        if cpu_per_round is None:
            return None
        return statistics.median(c - off for c, off in zip(cpu_per_round[mode], cpu_per_round["off"], strict=True))

    sync, async_ = blocking_per_save(run_dirs["sync"]), blocking_per_save(run_dirs["async"])
    sync_median, async_median = statistics.median(sync), statistics.median(async_)
    return StallResult(
        state_bytes=state_bytes, world_size=world, interval_steps=interval, steps=steps,
        sync_blocking_s=sync_median, async_blocking_s=async_median,
        sync_blocking_per_save_s=sync, async_blocking_per_save_s=async_,
        blocking_ratio=async_median / sync_median,
        step_wall_off_s=walls["off"], step_wall_sync_s=walls["sync"], step_wall_async_s=walls["async"],
        efficiency_sync=walls["off"] / walls["sync"], efficiency_async=walls["off"] / walls["async"],
        run_dirs={mode: str(path) for mode, path in run_dirs.items()},
        cpu_per_save_sync_s=cpu_per_save("sync"), cpu_per_save_async_s=cpu_per_save("async"),
        writer_cpu_per_save_async_s=statistics.median(writer_cpu_per_round) if writer_cpu_per_round else None,
        async_setup_s=async_setup_s)


def leaves_no_cpu_spare(world: int, cpus: int) -> bool:
    """Whether `world` ranks of one thread each keep every CPU busy."""
    return world >= cpus


def spare_cpu_world(world: int, cpus: int) -> int | None:
    """Ranks for a second CPU pass that leaves one CPU to the background writer, as a GPU host's idle
    cores do; None where the first pass already leaves one spare, or there is a single CPU."""
    return cpus - 1 if leaves_no_cpu_spare(world, cpus) and cpus >= 2 else None


def calibrated_interval(step_s: float, save_s: float) -> int:
    """Steps between saves at which sync saves take CALIBRATED_SYNC_COST of the time."""
    steps = save_s * (1 - CALIBRATED_SYNC_COST) / (CALIBRATED_SYNC_COST * step_s)
    return min(max(math.ceil(steps), MIN_INTERVAL), MAX_INTERVAL)


def checkpoint_bytes(checkpoint_dir: Path) -> int:
    """Bytes of the newest committed checkpoint under `checkpoint_dir`."""
    newest = max(checkpoint_dir.glob("step_*"))
    return sum(f.stat().st_size for f in newest.rglob("*") if f.is_file())


def _fresh_run_dirs(root: Path) -> dict[str, Path]:
    run_dirs = {mode: root / f"stall-{mode}" for mode in MODES}
    for path in run_dirs.values():
        shutil.rmtree(path, ignore_errors=True)
    return run_dirs


def _checkpoints(run_dir: Path) -> Path:
    """Where a stall run in `run_dir` saves: the checkpoint section's default directory."""
    return Path(CheckpointConfig().directory(run_dir))


def measure_stall_on_cluster(preset: str, device: str, world: int, interval: int, saves: int,
                             root: Path) -> StallResult:
    run_dirs = _fresh_run_dirs(root)
    steps = (saves + 1) * interval  # the last counted save is followed by a whole interval
    state_bytes = 0
    for mode, run_dir in run_dirs.items():
        status = run_cluster(ClusterSpec(
            run_dir=run_dir, shape=ClusterShape(nodes=1, nproc_per_node=world, node_retries=0), steps=steps,
            overrides=(f"model.preset={preset}", f"training.device={device}", f"checkpoint.mode='{mode}'",  # quoted: YAML reads a bare off as false
                       f"checkpoint.interval={interval}", "checkpoint.keep=1", "logging.log_interval=1")))
        if status != 0:
            raise RuntimeError(f"checkpoint stall run ({mode}) failed: see {run_dir}/logs/")
        if mode == "sync":
            state_bytes = checkpoint_bytes(_checkpoints(run_dir))
        shutil.rmtree(_checkpoints(run_dir), ignore_errors=True)
    walls = {mode: step_wall_s(path) for mode, path in run_dirs.items()}
    return analyse(run_dirs, walls, state_bytes, world, interval, steps)


def measure_stall(spec: StallSpec, root: Path) -> StallResult:
    run_dirs = _fresh_run_dirs(root)
    # rank 0 -> here: (interval, wall per mode, CPU time per round of each mode and of the async writer process
    # (means over ranks), the async writer's setup, checkpoint bytes)
    found = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_worker, args=(spec, free_port(), root, run_dirs, found), nprocs=spec.world,
                       start_method="spawn")
    interval, walls, cpu_per_round, writer_cpu_per_round, setup_s, state_bytes = found.get()
    steps = spec.saves * interval
    return analyse(run_dirs, {mode: wall / steps for mode, wall in walls.items()}, state_bytes, spec.world,
                   interval, steps, cpu_per_round, writer_cpu_per_round, setup_s)


def _worker(rank: int, spec: StallSpec, port: int, root: Path, run_dirs: dict[str, Path], found) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(spec.world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # one core per rank, as the local cluster's OMP_NUM_THREADS=1
    info = init_distributed(spec.device, timeout_s=600)
    try:
        state = synthetic_state(spec.state_bytes // spec.world, rank, info.device)
        a = torch.randn(512, 512, device=info.device)
        interval = _calibrate(spec, root / "stall-calibration", state, a, info.device)
        walls, cpus, setup_s = _interleaved(spec, interval, run_dirs, state, a, info.device)
        mean_cpus = torch.tensor([cpus[mode] for mode in (*MODES, WRITER)], dtype=torch.float64)  # (modes + writer) x rounds
        dist.all_reduce(mean_cpus)
        mean_cpus /= spec.world
        *per_mode, writer = mean_cpus.tolist()
        if rank == 0:
            found.put((interval, walls, dict(zip(MODES, per_mode)), writer, setup_s,
                       checkpoint_bytes(_checkpoints(run_dirs["sync"]))))
            for path in run_dirs.values():  # do not leave GBs behind
                shutil.rmtree(_checkpoints(path), ignore_errors=True)
    finally:
        teardown()


def synthetic_state(nbytes: int, rank: int, device: torch.device) -> dict[str, dict[str, torch.Tensor]]:
    """A rank's shard of state, in tensors of at most CHUNK_BYTES: synthetic, as a real model of 256 MB+
    trains far too slowly on 2 cores."""
    # Rank-unique keys: DCP writes each rank's shard (identical keys would be deduplicated as replicas).
    chunks, rest = divmod(nbytes, CHUNK_BYTES)
    sizes = [CHUNK_BYTES] * chunks + ([rest] if rest else [])
    return {f"shard_rank{rank}": {f"t{i}": torch.rand(n // 4, device=device) for i, n in enumerate(sizes)}}


def _step(a: torch.Tensor, matmuls: int) -> None:
    x = a
    for _ in range(matmuls):
        x = torch.tanh(x @ a)
    dist.all_reduce(x[:1, :1].contiguous())  # ranks move in lockstep, as in data-parallel training


def _update(state: dict[str, dict[str, torch.Tensor]]) -> None:
    """What an optimizer step does to the state, in kind: it writes every tensor in place (one element of each:
    the write, not its cost)."""
    for shard in state.values():
        for tensor in shard.values():
            tensor[:1].add_(1.0)


def _calibrate(spec: StallSpec, scratch: Path, state: dict, a: torch.Tensor, device: torch.device) -> int:
    """Time a few steps and one sync save (which also warms up allocator, threads and page cache)."""
    _step(a, spec.matmuls_per_step)
    t0 = time.perf_counter()
    for _ in range(CALIBRATION_STEPS):
        _step(a, spec.matmuls_per_step)
    step_s = (time.perf_counter() - t0) / CALIBRATION_STEPS
    ckpt = CheckpointManager(CheckpointConfig(dir=str(scratch), mode="sync", keep=1), scratch.parent, device=device)
    t0 = time.perf_counter()
    ckpt.save(0, state)
    timings = torch.tensor([step_s, time.perf_counter() - t0])
    dist.all_reduce(timings, op=dist.ReduceOp.MAX)  # every rank must pick the same interval
    if dist.get_rank() == 0:
        shutil.rmtree(scratch, ignore_errors=True)
    return calibrated_interval(*timings.tolist())


def _interleaved(spec: StallSpec, interval: int, run_dirs: dict[str, Path], state: dict, a: torch.Tensor,
                 device: torch.device) -> tuple[dict[str, float], dict[str, list[float]], float]:
    """`spec.saves` rounds of every mode, one interval of each per round, so that a change in the machine's
    load hits every mode alike. A round of a mode: a save (none with checkpoints off), `interval` steps, then
    the wait for an async save to be durable, so that a background write is charged to its own mode. Returns
    each mode's total wall time (rank 0's clock), the CPU time in each round of each mode of this process (all
    its threads) and, under WRITER, of its async writer process in each async round, and the async writer's
    setup time."""
    lead = dist.get_rank() == 0
    logs = {mode: EventLog(path, "rank0") if lead else None for mode, path in run_dirs.items()}
    managers = {mode: CheckpointManager(CheckpointConfig(mode=mode, keep=1), path, events=logs[mode], device=device)
                for mode, path in run_dirs.items()}
    started = time.perf_counter()
    managers["async"].prepare(state)  # as training does after its first step; its buffers are no save's
    managers["async"].wait_for_writer()  # as a rank's setup does: its start-up is no save's either
    setup_s = time.perf_counter() - started
    writer = _process_cpu_s(managers["async"].writer_pid)
    walls = dict.fromkeys(MODES, 0.0)
    cpus: dict[str, list[float]] = {mode: [] for mode in (*MODES, WRITER)}
    for round_ in range(spec.saves):
        for mode in MODES:
            t0, cpu0, writer0 = time.perf_counter(), time.process_time(), writer()
            managers[mode].save(round_ * interval, state)  # a no-op with checkpoints off
            for step in range(round_ * interval + 1, (round_ + 1) * interval + 1):
                started = time.perf_counter()
                _step(a, spec.matmuls_per_step)
                managers[mode].wait_staged()  # as training does before its optimizer step
                _update(state)
                if lead:
                    logs[mode].emit("step", step=step, loss=0.0, step_time_s=round(time.perf_counter() - started, 5),
                                    tokens=0)
                managers[mode].poll()
            managers[mode].wait()
            walls[mode] += time.perf_counter() - t0
            cpus[mode].append(time.process_time() - cpu0)
            if mode == "async":
                cpus[WRITER].append(writer() - writer0)
    for mode, log in logs.items():
        if log is not None:
            log.emit("run_end", step=spec.saves * interval, status="completed")
            log.close()
    for manager in managers.values():
        manager.close()
    return walls, cpus, setup_s


def _process_cpu_s(pid: int | None) -> Callable[[], float]:
    """A clock of the CPU time (user + system) of process `pid`; always 0 where there is none."""
    if pid is None:
        return lambda: 0.0
    process = psutil.Process(pid)
    return lambda: sum(process.cpu_times()[:2])
