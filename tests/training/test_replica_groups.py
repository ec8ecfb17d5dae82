"""Replica groups (parallel.replica_groups, training/train/replica_groups.py): two groups of two FSDP2 ranks
under a Lighthouse in this process, each rank forked from it (torch imported once), the test playing each
group's ft_launcher: when a rank of a group dies, the rest of the group is killed and the group restarted.
What a user is promised: the surviving group trains on after a short stall, the failed one heals from its
live state, both end bitwise equal, the losses are an uninterrupted run's and every sample is trained once; with
the preset and with a Hugging Face model, whose state the heal sends as it is."""
from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import os
import select
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from training.contract.config import ParallelConfig, TrainConfigError, load_train_config
from training.contract.events import read_events
from training.contract.exit_codes import CONFIG_ERROR
from training.contract.k8s_delays import EKS
from training.contract.launcher import free_port
from training.contract.replica_groups import LIGHTHOUSE_ENV, REPLICA_GROUP_ENV, check_torchft, share_of
from training.models.tiny import write_tiny_model
from training.train import trainer
from training.train.checkpoint.layout import committed_checkpoints, step_dir_name
from training.train.final_state import bitwise_mismatch, load_final_state
from training.train.replica_groups import _FreshPrefix, start_lighthouse
from training_helpers import exit_code, fork_rank, samples_by_step

STEPS, BATCH, GLOBAL_BATCH, RANKS = 96, 2, 8, 2  # 4 micro-batches a step: rows of 2, one row per group;
# enough steps for a slow machine: a late start and a restart each take ~20 of the survivor's steps here
SHAPE = (f"training.steps={STEPS}", f"training.batch_size={BATCH}", f"training.global_batch_size={GLOBAL_BATCH}",
         "training.seq_len=16", "training.device=cpu", "training.collective_timeout_s=10", "checkpoint.mode=off",
         "checkpoint.save_final=true", "logging.sample_log=true", "logging.log_interval=100")
GROUPS = ("parallel.replica_groups=2", "parallel.step_timeout_s=5")
FAULT_STEP = 6
ALONE_STEPS = 3  # the failed group comes back once the survivor committed this many steps without it
STALL_BOUND_S = 6.0  # heartbeat_timeout_s (1 s) plus re-forming the quorum's process group, on 2 busy cores


@dataclass
class Group:
    """One replica group's ranks, as its launcher sees them."""
    index: int
    run_dir: Path
    overrides: tuple[str, ...]
    pids: list[int]
    restarts: int = 0


def _fork_rank(group: Group, rank: int, port: int, lighthouse: str | None) -> int:
    """A rank of `group`, forked from this process: training.train's entry point with the group's env."""
    env = {"RANK": str(rank), "WORLD_SIZE": str(RANKS), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(RANKS),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), REPLICA_GROUP_ENV: str(group.index),
           **({LIGHTHOUSE_ENV: lighthouse} if lighthouse is not None else {})}
    return fork_rank(lambda: trainer.main([f"run_dir={group.run_dir}", *group.overrides]),
                     group.run_dir / f"rank{rank}.{group.restarts}.log", env)


def _start(group: Group, lighthouse: str | None) -> None:
    group.run_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()  # a fresh store per attempt, as a new worker group gets one
    group.pids = [_fork_rank(group, rank, port, lighthouse) for rank in range(RANKS)]


def _run(groups: list[Group], lighthouse: str | None, restart_when: Callable[[], bool] = lambda: True,
         timeout: float = 120) -> None:
    """Until every group's ranks exit 0; a group one of whose ranks fails is killed whole and started again
    (ft_launcher's in-job restart), at most once, as soon as `restart_when()` (a restart takes time: here the
    test says how long). Whatever is left when it fails is killed."""
    for group in groups:
        _start(group, lighthouse)
    running = {pid: group for group in groups for pid in group.pids}
    try:
        _supervise(running, lighthouse, restart_when, time.monotonic() + timeout)
    finally:
        for pid in running:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


def _supervise(running: dict[int, Group], lighthouse: str | None, restart_when: Callable[[], bool],
               deadline: float) -> None:
    down: list[Group] = []
    while running or down:
        assert time.monotonic() < deadline, (f"ranks still running: {running}, groups down: {down}; their logs: "
                                             f"{'; '.join(_logs(g) for g in {id(g): g for g in running.values()}.values())}")
        for group in [g for g in down if restart_when()]:
            down.remove(group)
            group.restarts += 1
            _start(group, lighthouse)
            running.update({p: group for p in group.pids})
        pid, status = os.waitpid(-1, os.WNOHANG) if running else (0, 0)
        if pid == 0:
            time.sleep(0.05)
            continue
        group = running.pop(pid, None)
        if group is None or os.waitstatus_to_exitcode(status) == 0:
            continue
        assert group.restarts == 0, f"group {group.index} failed again: {_logs(group)}"
        for other in group.pids:  # the launcher stops the rest of its worker group
            if other in running:
                os.kill(other, signal.SIGKILL)
                os.waitpid(other, 0)
                running.pop(other)
        down.append(group)


def _logs(group: Group) -> str:
    return "\n".join(p.read_text()[-2000:] for p in sorted(group.run_dir.glob("rank*.log")))


def _steps(run_dir: Path) -> list[dict]:
    return [e for e in read_events(run_dir) if e["event"] == "step"]


def _trained_alone(run_dir: Path) -> int:
    """Steps the group committed since its last quorum of one live group (0 while in a larger one)."""
    events = [e for e in read_events(run_dir) if e["event"] in ("quorum", "step")]
    quorums = [i for i, e in enumerate(events) if e["event"] == "quorum"]
    if not quorums or events[quorums[-1]]["live_groups"] != 1:
        return 0
    return sum(e["event"] == "step" for e in events[quorums[-1]:])


@contextlib.contextmanager
def _lighthouse(cfg: ParallelConfig, scratch: Path) -> Iterator[str]:
    """torchft's LighthouseServer in a process forked from this one, its address; this process never runs
    torchft's Rust runtime itself: a rank forked after it has would inherit the runtime without its threads
    and block in its first call (seen here: the main thread parked in tokio, in the Manager's creation)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.dup2(os.open(scratch / "lighthouse.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND), 2)
            server = start_lighthouse(cfg)
            os.write(write, server.address().encode())
            signal.pause()
        finally:
            os._exit(1)
    os.close(write)
    try:
        started, _, _ = select.select([read], [], [], 60)
        address = os.read(read, 200).decode() if started else ""
        assert address, "the Lighthouse did not start within 60 s"
        yield address
    finally:
        os.close(read)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


@pytest.fixture(scope="module")
def model_args(tmp_path_factory) -> Callable[[str], tuple[str, ...]]:
    """model_args(model): the overrides of the preset ("preset") or of a tiny Hugging Face Llama ("llama"),
    written once from its config and trained from its safetensors."""
    @functools.cache
    def get(model: str) -> tuple[str, ...]:
        if model == "preset":
            return ()
        return ("model.source=huggingface", f"model.path={write_tiny_model(tmp_path_factory.mktemp(model), model)}")
    return get


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, model_args) -> Callable[[str], Path]:
    """uninterrupted(model): the same global batch on one FSDP2 group of the same 2 ranks
    (parallel.replica_groups=1), run once per model."""
    @functools.cache
    def get(model: str) -> Path:
        group = Group(0, tmp_path_factory.mktemp("reference") / "run", (*SHAPE, *model_args(model)), [])
        _run([group], lighthouse=None)
        return group.run_dir
    return get


@pytest.mark.slow
@pytest.mark.alone  # its stall bound
@pytest.mark.parametrize("fault, model", [("sigkill@{}:rank=0:group=1", "preset"),
                                          ("exception@{}:rank=1:group=1", "llama")],
                         ids=["sigkill-rank0", "exception-rank1-hf-llama"])
def test_a_failed_group_leaves_the_quorum_the_other_trains_on_and_it_heals_from_live_state(
        tmp_path, uninterrupted, model_args, fault, model):
    shape = (*SHAPE, *model_args(model))
    survivor = Group(0, tmp_path / "group0", (*shape, *GROUPS), [])
    failing = Group(1, tmp_path / "group1", (*shape, *GROUPS, f"faults={fault.format(FAULT_STEP)}"), [])
    with _lighthouse(load_train_config(None, [*SHAPE, *GROUPS]).parallel, tmp_path) as address:
        started = time.monotonic()
        _run([survivor, failing], address, restart_when=lambda: _trained_alone(survivor.run_dir) >= ALONE_STEPS)
        took = time.monotonic() - started
    assert failing.restarts == 1, _logs(failing)
    # the group that asks first starts alone, the other heals into the quorum from it when it gets there: past
    # FAULT_STEP on a slow machine, and the fault fires at the first step after it that the group trains
    [fired] = [e["step"] for e in read_events(failing.run_dir) if e["event"] == "fault_injected"]

    # the survivor never stopped for longer than the bound, and lost at most the step in flight
    steps = _steps(survivor.run_dir)
    first = steps[0]["step"]
    assert first < fired and [e["step"] for e in steps] == list(range(first, STEPS + 1))
    stall = max(b["t"] - a["t"] for a, b in zip(steps, steps[1:]))
    assert stall < STALL_BOUND_S, f"survivor stalled {stall:.2f} s"
    discarded = [e["step"] for e in read_events(survivor.run_dir) if e["event"] == "step_discarded"]
    assert discarded in ([], [fired]), discarded
    quorums = [(e["step"], e["live_groups"]) for e in read_events(survivor.run_dir) if e["event"] == "quorum"]
    lost, rejoined = quorums[-2:]  # before them: alone at the start, then both
    assert lost == (fired - 1, 1) and rejoined[1] == 2 and rejoined[0] > lost[0], quorums

    # the restarted group healed from the survivor's live state, at a later step, not from step 0
    [healed] = [e for e in read_events(failing.run_dir)
                if e["event"] == "quorum" and e["healed_from_step"] == 0 and e["step"] >= fired + ALONE_STEPS - 1]
    assert healed["live_groups"] == 2
    resumed = [e for e in read_events(failing.run_dir) if e["event"] == "resume"][-1]
    assert (resumed["source_kind"], resumed["step"]) == ("live", healed["step"])  # the heal was its resume
    restarted = [e for e in read_events(failing.run_dir) if e["event"] == "attempt_start"][-1]
    print(f"\n{fault}: survivor's longest stall {stall:.2f} s, discarded {discarded}; group 1 healed at step "
          f"{healed['step']}, {healed['t'] - restarted['t']:.2f} s from its start to the heal; {took:.1f} s in all",
          file=sys.stderr)

    # both groups end with the same parameters and optimizer state, bit for bit
    mismatch = bitwise_mismatch(load_final_state(survivor.run_dir, tmp_path), load_final_state(failing.run_dir, tmp_path))
    assert mismatch is None, mismatch

    # the losses are the uninterrupted run's (another split of the same samples: float tolerance)
    reference = {e["step"]: e["loss"] for e in _steps(uninterrupted(model))}
    assert {e["step"]: e["loss"] for e in steps} == pytest.approx({s: reference[s] for s in range(first, STEPS + 1)},
                                                                  rel=1e-5, abs=1e-6)

    # every sample of every step trained once, by whichever groups were live
    by_step = samples_by_step(survivor.run_dir)
    for step, indices in samples_by_step(failing.run_dir).items():
        by_step.setdefault(step, []).extend(indices)
    for step in range(1, STEPS + 1):
        assert sorted(by_step[step]) == list(range((step - 1) * GLOBAL_BATCH, step * GLOBAL_BATCH)), step


LOST_STEP, SAVE_INTERVAL = 25, 10


@pytest.mark.slow  # two groups of two ranks, lost together and restarted
def test_every_group_lost_at_once_resumes_from_the_one_copy_of_the_newest_checkpoint(tmp_path, uninterrupted):
    """Each checkpoint is written by one group, the quorum's first; after every group is lost, the first back
    resumes from the newest of them wherever it lies (checkpoint.also_resume_from, which the chart and the
    local cluster set), the others from it, and the run ends as the uninterrupted one."""
    dirs = [tmp_path / f"group{g}" for g in (0, 1)]
    saves = ("checkpoint.mode=async", f"checkpoint.interval={SAVE_INTERVAL}", "checkpoint.keep=20")
    groups = [Group(g, dirs[g], (*SHAPE, *GROUPS, *saves, f"faults=exception@{LOST_STEP}:rank=1:group={g}",
                                 f"checkpoint.also_resume_from={dirs[1 - g] / 'checkpoints'}"), []) for g in (0, 1)]
    fired = lambda g: any(e["event"] == "fault_injected" for e in read_events(g.run_dir))  # noqa: E731
    with _lighthouse(load_train_config(None, [*SHAPE, *GROUPS]).parallel, tmp_path) as address:
        _run(groups, address, restart_when=lambda: all(map(fired, groups)))
    assert [g.restarts for g in groups] == [1, 1], _logs(groups[1])

    # every periodic checkpoint once, in one group's directory or the other's
    written = sorted(step for d in dirs for step, _ in committed_checkpoints(d / "checkpoints"))
    assert written == list(range(SAVE_INTERVAL, STEPS + 1, SAVE_INTERVAL)), written

    # the first group back resumed at the newest step committed before the loss, whichever group had written
    # it; a group back while another trains heals from that one's live state and reads no checkpoint
    resumes = [[e for e in read_events(d) if e["event"] == "resume"][-1] for d in dirs]
    newest = LOST_STEP - LOST_STEP % SAVE_INTERVAL
    [held] = [path for d in dirs if (path := d / "checkpoints" / step_dir_name(newest)).is_dir()]
    from_disk = [r for r in resumes if r["source_kind"] == "disk"]
    assert from_disk and all((r["step"], Path(r["path"])) == (newest, held) for r in from_disk), resumes
    assert all(r["source_kind"] == "live" and r["step"] >= newest for r in resumes if r not in from_disk), resumes

    # the end: both groups bitwise equal, the uninterrupted run's losses, every sample of each step trained
    mismatch = bitwise_mismatch(load_final_state(dirs[0], tmp_path), load_final_state(dirs[1], tmp_path))
    assert mismatch is None, mismatch
    reference = {e["step"]: e["loss"] for e in _steps(uninterrupted("preset"))}
    last = {e["step"]: e["loss"] for d in dirs for e in _steps(d)}  # a replayed step's last loss
    assert last == pytest.approx(reference, rel=1e-5, abs=1e-6)
    by_step = samples_by_step(dirs[0])
    for step, indices in samples_by_step(dirs[1]).items():
        by_step.setdefault(step, []).extend(indices)
    for step in range(1, STEPS + 1):
        expected = list(range((step - 1) * GLOBAL_BATCH, step * GLOBAL_BATCH))
        replayed = newest < step <= LOST_STEP  # trained before the loss, and again after the resume
        assert (sorted(set(by_step[step])) if replayed else sorted(by_step[step])) == expected, step


def test_the_live_groups_share_a_step_by_rows_and_weigh_them_by_samples():
    # 5 rows over 2 live groups: 3 and 2, contiguous; over 1: all 5; weights sum to the whole step
    assert [(s.first_row, s.rows) for s in (share_of(5, 2, 0), share_of(5, 2, 1))] == [(0, 3), (3, 2)]
    assert (share_of(5, 1, 0).first_row, share_of(5, 1, 0).rows, share_of(5, 1, 0).weight) == (0, 5, 1.0)
    assert sum(share_of(6, 4, i).weight for i in range(4)) == pytest.approx(1.0)


def test_a_global_batch_the_groups_cannot_share_is_refused_naming_what_can():
    with pytest.raises(TrainConfigError, match=r"parallel.replica_groups=3 is not allowed: training.global_batch_size"
                                               r"=4 in micro-batches of 2: 2 micro-batch\(es\) per step cannot give "
                                               r"each of 3 replica groups one: .* or at most 2 groups"):
        load_train_config(None, ["parallel.replica_groups=3", "training.batch_size=2", "training.global_batch_size=4"])
    cfg = load_train_config(None, ["parallel.replica_groups=2", "training.batch_size=2", "training.global_batch_size=24"])
    with pytest.raises(TrainConfigError, match=r"cannot be reached by groups of 5 ranks: 12 micro-batches per step "
                                               r"cannot be split into rows of 5 .* allowed ranks per group: \[1, 2, 3, "
                                               r"4, 6\]"):
        cfg.rows_per_step(5)
    assert cfg.rows_per_step(6) == 2  # rows of 6 micro-batches: one per group, or both for one live group
    assert load_train_config(None, ["parallel.replica_groups=2"]).rows_per_step(4) == 2  # null: a row per group


def test_a_quorum_id_a_restarted_lighthouse_reuses_gets_a_store_prefix_of_its_own():
    """torchft names a process group's store prefix by the quorum id, which a restarted Lighthouse counts from 1
    again: the members of each configure must agree on a prefix that no earlier process group wrote to."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    configured: list[str] = []

    class Recorded:
        def configure(self, store_addr: str, *args: object) -> None:
            configured.append(store_addr)

    class Fresh(_FreshPrefix, Recorded):
        _timeout = timedelta(seconds=5)

    reused = f"127.0.0.1:{server.port}/torchft/2/0"
    for _ in ("the first Lighthouse's quorum 2", "the restarted one's"):
        for rank in (0, 1):
            Fresh().configure(reused, f"group{rank}", rank, 2, 2)
    assert configured == [f"{reused}/0"] * 2 + [f"{reused}/1"] * 2


def test_by_default_the_groups_wait_out_a_lighthouse_moved_to_another_system_node():
    # its node lost, the Lighthouse runs again on another system node after this long; meanwhile every group
    # keeps its state and asks every second (test_local_replica_groups kills it), so none restarts
    assert ParallelConfig().quorum_timeout_s > EKS.system_pod_moved_s


def test_replica_groups_without_torchft_stop_before_any_rank_trains(monkeypatch, tmp_path, capsys):
    real = importlib.metadata.version

    def without_torchft(name: str) -> str:
        if name == "torchft":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", without_torchft)
    assert check_torchft().startswith("parallel.replica_groups >= 2 needs torchft 0.2.0, which is not installed here")
    assert exit_code(trainer.main, [f"run_dir={tmp_path}", "parallel.replica_groups=2"]) == CONFIG_ERROR
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("training.train: invalid training config: parallel.replica_groups >= 2 needs torchft")
    assert not (tmp_path / "events").exists()
