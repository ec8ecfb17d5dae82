"""In-process restart (training/train/inprocess.py): unit checks of the Wrapper adapter, the config rules and
the in-memory rollback; then runs in the local cluster (under ft_launcher, as the pods): in one run an
exception and a hang restart every rank in-process from the last step in memory, and a killed process falls
back to an in-job restart from disk, bitwise equal to an uninterrupted run; a persistent fault ends the job
after the in-process budget, naming the rank and the fault."""
from __future__ import annotations

import errno
import gc
import inspect
import json
import math
import os
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from datetime import datetime, timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from nvidia_resiliency_ext import inprocess
from nvidia_resiliency_ext.inprocess.attribution import Interruption, InterruptionRecord
from nvidia_resiliency_ext.inprocess.store import PrefixStore as WrapperIterationStore
from torch.distributed.checkpoint.stateful import Stateful

from training.contract.config import (RESTART_MODES, DataConfig, FaultToleranceConfig, TrainConfigError, TrainingConfig,
                                      load_train_config)
from training.contract.events import read_events
from training.contract.launcher import (HANG_FLOOR_MARGIN_S, STORE_ENDPOINT_ENV, free_port, launcher_ft_args,
                                       section_timeout_floor)
from training.contract.shapes import PRESETS
from training.data.stream import TokenStream
from training.models.spec import model_spec
from training.report.goodput import build_report
from training.train.coordination import Coordination, WrapperStore
from training.train.hang_watch import HangWatch
from training.train.inprocess import (FaultLog, RestartBudget, _peer_lost, lost_ranks_watch, make_wrapper,
                                      wrapper_kwargs)
from training.train import inprocess as inprocess_module
from training.train.lost_ranks import LostRanks
from training.train.monitor import RankMonitor
from training.train import rollback as rollback_module
from training.train.rollback import KEEP, MemoryRollback, copy_into
from training.train.optimizer_step import OptimizerStep
from training.train.trainer import ModelState, OptimizerState, RngState, TrainState, build
from training_helpers import (ONE_NODE, TWO_NODES, assert_bitwise_equal, completed, events_named, fork_ranks,
                              load_final_state, run_local)

# ---- the Wrapper adapter and the config ---------------------------------------------------------


def _cfg(*overrides):
    return load_train_config(None, ["run_dir=/tmp/x", "fault_tolerance.restart=both", *overrides])


def _budget(max_restarts=3, world_size=2, store=None):
    store = dist.HashStore() if store is None else store
    return RestartBudget(max_restarts, world_size, FaultLog(store), store, timedelta(seconds=10))


def _start(budget, iteration, rank=0, world_size=1):
    """The Wrapper's Initialize at the start of `iteration` (the fields of FrozenState it reads)."""
    return budget(SimpleNamespace(iteration=iteration, rank=rank, world_size=world_size))


OFF_NODE = Coordination("store.ns", 29400, "training/r/cycle3-node0:29500", None)


def test_wrapper_kwargs_fit_the_installed_signature():
    kwargs = wrapper_kwargs(_cfg(), coordination=OFF_NODE, master_port=29500, on_cuda=False, initialize=_budget(),
                            finalize=lost_ranks_watch(_cfg(), OFF_NODE))
    assert set(kwargs) <= set(inspect.signature(inprocess.Wrapper.__init__).parameters)
    assert kwargs["store_factory"] is WrapperStore
    assert kwargs["store_kwargs"] == {"host": "store.ns", "port": 29400, "host_rank": None,
                                      "prefix": "training/r/cycle3-node0:29500/wrapper"}
    assert kwargs["abort"].keep_ports == {29500, 29400}  # the launcher's and the coordination store survive
    assert kwargs["health_check"] is None  # no CUDA/NVML check on a CPU machine
    assert isinstance(kwargs["finalize"], LostRanks)  # a lost node's ranks are arrived for at the restart barrier
    # the monitor process must poll faster than progress is reported (else it skips its timeout checks)
    assert kwargs["monitor_process_interval"] < kwargs["progress_watchdog_interval"] < kwargs["soft_timeout"]
    assert kwargs["soft_timeout"] == timedelta(seconds=60) and kwargs["hard_timeout"] == timedelta(seconds=90)
    # a node whose monitor processes went silent (lost, cut off) is handed to the launcher within seconds,
    # not after the hang timeouts: the heartbeat timeout is what the survivors' restart barrier waits for
    assert kwargs["heartbeat_interval"] < kwargs["heartbeat_timeout"] <= timedelta(seconds=5)
    inprocess.Wrapper(**kwargs)  # the installed NVRx accepts them


def test_make_wrapper_hides_local_rank_on_cpu(monkeypatch, tmp_path):
    seen = {}

    class Wrapper070:  # records what the Wrapper would see
        def __init__(self, *, monitor_process_pidfile=None, **rest):
            seen.update(local_rank=os.environ.get("LOCAL_RANK"), pidfile=monitor_process_pidfile)

    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    cfg = _cfg(f"run_dir={tmp_path}")
    make_wrapper(cfg, OFF_NODE, _budget(), lost_ranks_watch(cfg, OFF_NODE), wrapper_cls=Wrapper070)
    assert seen["local_rank"] is None  # 0.7.0 would add NVML GPU checks to every restart
    assert seen["pidfile"].endswith("logs/inprocess_monitor_rank{rank}.pid")
    assert os.environ["LOCAL_RANK"] == "1"  # restored


@pytest.mark.parametrize("overrides, message", [
    (["fault_tolerance.restart=sometimes"], "fault_tolerance.restart='sometimes' is not allowed: one of "
                                            "['injob', 'both']"),
    (["fault_tolerance.restart=inprocess"], "fault_tolerance.restart='inprocess' is not allowed: one of "
                                            "['injob', 'both'] (both: the Wrapper restarts the ranks"),
    (["fault_tolerance.inprocess_soft_timeout=90"], "inprocess_soft_timeout (90.0) must be greater than 0 and less "
                                                    "than inprocess_hard_timeout (90.0)"),
    (["fault_tolerance.inprocess_hard_timeout=200"], "inprocess_hard_timeout (200.0) must be less than "
                                                     "step_section_timeout (180.0) with restart=both"),
    (["fault_tolerance.restart=both", "fault_tolerance.rank_heartbeat_timeout=60"],
     "less than rank_heartbeat_timeout (60.0) with restart=both: otherwise the launcher's rank monitor kills"),
    (["fault_tolerance.inprocess_max_restarts=-1"], "inprocess_max_restarts=-1 is not allowed: 0 or more"),
])
def test_contradictory_inprocess_config_is_named(overrides, message):
    with pytest.raises(TrainConfigError) as err:
        _cfg(*overrides)
    assert message in str(err.value)


def test_learned_timeouts_never_undercut_the_wrappers_hard_timeout():
    assert section_timeout_floor(_cfg().fault_tolerance) == 90 + HANG_FLOOR_MARGIN_S
    assert section_timeout_floor(_cfg("fault_tolerance.restart=injob").fault_tolerance) == 0


def test_restart_budget_counts_restarts_without_progress():
    budget = _budget(world_size=1)  # 3
    _start(budget, 0)
    for iteration, step in enumerate([4, 9, 9, 9, 12, 12, 12, 12], start=1):  # 9 then 12: progress
        budget.completed(step)  # the newest step completed before iteration `iteration` started
        _start(budget, iteration)
    assert budget.without_progress == 3
    with pytest.raises(inprocess.exception.RestartAbort, match="4 in-process restarts in a row made no progress"):
        _start(budget, 9)


def test_restart_budget_counts_iterations_that_failed_in_setup():
    """A deterministic failure before any step (a checkpoint manager, a model build) spends the budget too."""
    budget = _budget(world_size=1)  # 3
    budget.completed(4)  # iteration 0 trained to step 4, then failed; every later one fails in setup
    for iteration in range(1, 5):
        _start(budget, iteration)
    with pytest.raises(inprocess.exception.RestartAbort, match="4 in-process restarts in a row made no progress"):
        _start(budget, 5)


def test_restart_budget_decides_on_the_step_every_rank_completed():
    """Rank 0 completed step 5, rank 1 only 4: progress up to 4; step 5 counts once both completed it.
    Each rank decides alike, from the keys of both in the store."""
    store = dist.HashStore()
    budgets = [_budget(max_restarts=0, store=store) for _ in range(2)]

    def start_both(iteration):
        with ThreadPoolExecutor(2) as pool:  # each rank waits for the other's key
            done = [pool.submit(_start, b, iteration, rank, 2) for rank, b in enumerate(budgets)]
            return [f.exception() for f in done]

    budgets[0].completed(5)
    budgets[1].completed(4)
    assert start_both(1) == [None, None]
    budgets[1].completed(5)
    assert start_both(2) == [None, None]  # 5 > 4: progress
    errors = start_both(3)  # nothing newer: over a budget of 0 on both ranks
    assert all(isinstance(e, inprocess.exception.RestartAbort) for e in errors), errors


class FakeRankMonitorClient:
    """NVRx's RankMonitorClient as RankMonitor uses it: every calculated section timeout is 0.05 s."""
    CURRENT_TIMEOUTS_STATE_KEY = "current_timeouts"

    def __init__(self):
        self.section_timeouts = SimpleNamespace(section={"setup": 600.0, "step": 180.0, "checkpoint": 600.0})
        self.calculated_sections: list[str] = []

    def init_workload_monitoring(self): pass
    def start_section(self, name): pass
    def end_section(self, name): pass
    def send_heartbeat(self): pass
    def shutdown_workload_monitoring(self): pass

    def calculate_and_set_section_timeouts(self, selected_sections, calc_out_of_section):
        self.section_timeouts.section.update({name: 0.05 for name in selected_sections})
        self.calculated_sections = sorted(set(self.calculated_sections) | set(selected_sections))

    def state_dict(self):
        return {self.CURRENT_TIMEOUTS_STATE_KEY: {"section": {"section": dict(self.section_timeouts.section),
                                                              "calculated_sections": list(self.calculated_sections)}}}

    def load_state_dict(self, state):
        timeouts = state[self.CURRENT_TIMEOUTS_STATE_KEY]["section"]
        self.section_timeouts.section = dict(timeouts["section"])
        self.calculated_sections = list(timeouts["calculated_sections"])


def test_a_hang_under_the_wrapper_is_caught_at_the_calculated_step_timeout(monkeypatch):
    """restart=both raises the launcher's calculated timeouts above the Wrapper's hard timeout; the hang watch
    still applies the calculated one, so a hung step is reported as soon as injob's rank monitor would stop it,
    not after inprocess_soft_timeout (or gloo's timeout, for the peers blocked with the hung rank)."""
    import nvidia_resiliency_ext.fault_tolerance as ft_module
    monkeypatch.setattr(ft_module, "RankMonitorClient", FakeRankMonitorClient)
    monkeypatch.setenv("FT_RANK_MONITOR_IPC_SOCKET", "/nonexistent")
    watch = HangWatch(interval_s=0.01)
    cfg = _cfg("fault_tolerance.calculate_timeouts_after=2")
    monitor = RankMonitor(cfg.fault_tolerance, cfg.checkpoint.mode, watch)
    for _ in range(2):
        with monitor.section("step"):
            pass
        monitor.step_done()
    assert monitor._client.section_timeouts.section["step"] == 90 + HANG_FLOOR_MARGIN_S  # the launcher's: floored
    reports = []
    with watch.watching(lambda *late: reports.append(late)):
        with monitor.section("step"):  # in time: nothing to report
            pass
        with watch.paused(), monitor.section("step"):  # a drain's wait
            time.sleep(0.2)
        with monitor.section("step"):  # hung
            deadline = time.monotonic() + 10
            while not reports and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.1)  # no second report for the same hang
    [(section, open_s, timeout)] = reports
    assert (section, timeout) == ("step", 0.05) and open_s > 0.05
    # the next iteration resumes from the rollback: its monitor loads the learned timeouts, not the floor
    assert json.loads(monitor.state_dict())["current_timeouts"]["section"]["section"]["step"] == 0.05
    resumed = RankMonitor(cfg.fault_tolerance, cfg.checkpoint.mode, HangWatch(interval_s=0.01))
    resumed.load_state_dict(monitor.state_dict())
    assert resumed._client.section_timeouts.section["step"] == 90 + HANG_FLOOR_MARGIN_S
    with resumed._watch.watching(lambda *late: reports.append(late)), resumed.section("step"):
        deadline = time.monotonic() + 10
        while len(reports) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert [r[2] for r in reports] == [0.05, 0.05]


def _wrapper_run(cfg, setup_failure: BaseException) -> None:
    """One rank under the Wrapper, `training.train.run` with its checkpoint manager failing; prints the outcome."""
    from training.train import trainer

    def failing(*args, **kwargs):
        raise setup_failure

    trainer.CheckpointManager = failing  # this rank's own module: the test process keeps the real one
    try:
        inprocess_module.run_inprocess(cfg, trainer.run)
    except inprocess.exception.RestartAbort as err:
        print(f"outcome: {err}", flush=True)
    else:
        print("outcome: completed", flush=True)


def test_a_deterministic_setup_failure_ends_the_wrapper_after_its_budget(tmp_path, monkeypatch):
    """Every iteration fails in setup, before the resume: the Wrapper gives up after the budget (the launcher's
    in-job restart takes over) instead of restarting in-process for ever."""
    monkeypatch.delenv(STORE_ENDPOINT_ENV, raising=False)  # rank 0's process serves the stores
    cfg = _cfg(f"run_dir={tmp_path}", "training.device=cpu", "fault_tolerance.inprocess_max_restarts=2",
               "fault_tolerance.inprocess_soft_timeout=4", "fault_tolerance.inprocess_hard_timeout=15")
    # a forked rank (fork_rank) has one OpenMP thread: else the model's build can hang in libgomp, and the
    # Wrapper's hard timeout kills the rank mid-setup
    [rank] = fork_ranks(lambda _: _wrapper_run(cfg, OSError(errno.ENOSPC, "No space left on device")),
                        tmp_path / "logs", world=1, timeout=120)
    outcome = rank.output.partition("outcome: ")[2] or f"no outcome (exit code {rank.code}): {rank.output[-3000:]}"
    assert outcome.startswith("3 in-process restarts in a row made no progress (budget 2, "
                              "fault_tolerance.inprocess_max_restarts); the last failed with: rank 0: OSError: "), outcome
    assert "No space left on device" in outcome
    kinds = [e["restart_kind"] for e in events_named(tmp_path, "attempt_start")]
    assert kinds == ["fresh", "inprocess", "inprocess"]  # iteration 3 is refused before it starts


def _lost_node_barrier(alive_late: set[int]):
    """A world of 4 after a fault: ranks 0-1 survive and arrive at the restart barrier; of ranks 2-3,
    `alive_late` still heartbeats and arrives itself 1 s later; nothing arrives for the others (their node took
    its monitor processes with it), whose heartbeats are 10 s old. Returns the ranks the survivors arrived
    for and the terminated ranks."""
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # noqa: F841
    connect = lambda: WrapperStore("127.0.0.1", port, "training/r/cycle1/wrapper")  # noqa: E731
    store = WrapperIterationStore(1, connect())
    for rank in range(4):
        store.send_heartbeat(rank)
    store.set(store.HEARTBEAT.format(rank=2), str(time.time() - 10))  # gone
    store.set(store.HEARTBEAT.format(rank=3), str(time.time() - (0 if 3 in alive_late else 10)))
    watchers = [LostRanks(connect, timedelta(seconds=2), timedelta(seconds=20), 0.05) for _ in (0, 1)]

    def survivor(rank):
        with ThreadPoolExecutor(1) as watch:
            arrived_for = watch.submit(watchers[rank].watch, 1, 4)
            WrapperIterationStore(1, connect()).iteration_barrier(ranks=[rank], rendezvous_count=4,
                                                                  timeout=timedelta(seconds=10))
            return arrived_for.result()

    def late(rank):
        time.sleep(1.0)
        WrapperIterationStore(1, connect()).iteration_barrier(ranks=[rank], rendezvous_count=4,
                                                              timeout=timedelta(seconds=10))
        return set()
    with ThreadPoolExecutor(4) as pool:
        results = [pool.submit(survivor, r) for r in (0, 1)] + [pool.submit(late, r) for r in alive_late]
        arrived_for = set().union(*(f.result() for f in results))  # a BarrierTimeout raises here
    return arrived_for, store.get_terminated_ranks()


def test_the_survivors_barrier_opens_for_a_node_lost_with_its_monitor_processes():
    """Without LostRanks the survivors wait at the barrier for ranks nobody arrives for, until its timeout."""
    arrived_for, terminated = _lost_node_barrier(alive_late=set())
    assert arrived_for == terminated == {2, 3}  # the world shrinks: RestartBudget hands over to the launcher


def test_a_slow_rank_that_still_heartbeats_is_not_taken_for_lost():
    arrived_for, terminated = _lost_node_barrier(alive_late={3})
    assert arrived_for == terminated == {2}


def test_the_lost_ranks_watch_ends_before_the_next_iteration_runs():
    """The next iteration forks its checkpoint writer: no thread of the last one may be inside a store request."""
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # noqa: F841
    watcher = LostRanks(lambda: WrapperStore("127.0.0.1", port, "w"), timedelta(seconds=2), timedelta(seconds=60), 1.0)
    watcher(SimpleNamespace(iteration=1, world_size=4))  # nobody at the barrier: it would poll for a minute
    started = time.monotonic()
    watcher.stop()
    assert time.monotonic() - started < 2.0
    assert not [t for t in threading.enumerate() if t.name.startswith("lost-ranks")]


def test_the_lost_ranks_watch_never_raises_into_the_wrapper():
    def refuse():
        raise ConnectionRefusedError("store gone")
    assert LostRanks(refuse, timedelta(seconds=2), timedelta(seconds=1), 0.05).watch(1, 4) == set()


def test_launcher_restarts_what_the_wrapper_cannot_handle_in_every_mode():
    assert load_train_config(None, ["fault_tolerance.inprocess_hard_timeout=200"])  # injob: no constraint
    ft = {mode: FaultToleranceConfig(restart=mode, max_restarts=4, max_restarts_total=9) for mode in RESTART_MODES}
    assert {m: f.launcher_max_restarts for m, f in ft.items()} == {"injob": 9, "both": 9}
    assert "--max-restarts=9" in launcher_ft_args(ft["both"], "resume_step")
    assert FaultToleranceConfig(max_restarts=0).launcher_max_restarts == 0  # no restart at all


@pytest.mark.parametrize("message, peers", [
    ("[../third_party/gloo/gloo/transport/tcp/pair.cc:538] Read error [127.0.0.1]:41613: "
     "Connection reset by peer", True),
    ("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 1000ms for recv operation "
     "to complete: Connection closed by peer [127.0.0.1]:27745", True),
    ("NCCL error in: ProcessGroupNCCL.cpp:1969, remote process exited or there was a network error, "
     "NCCL version 2.27.3", True),
    # this rank's own watchdog aborts its communicator after a local fault: not a peer's
    ("NCCL communicator was aborted on rank 3. Original reason for failure was: CUDA error: an illegal memory "
     "access was encountered", False),
    ("CUDA out of memory. Tried to allocate 2.00 GiB", False),
    ("injected fault exception@12:rank=1", False),
])
def test_a_collective_broken_by_a_peer_counts_as_a_lost_peer(message, peers):
    assert _peer_lost(RuntimeError(message)) is peers


@pytest.mark.parametrize("recorded, waits", [(True, True), (False, False)])
def test_a_rank_waits_for_its_interrupt_only_where_a_peer_aborted(recorded, waits, monkeypatch):
    # a peer's abort comes after some rank's interruption is recorded: the rank waits for its own interrupt
    # (raising first made it land in the Wrapper's handler); a lost node records nothing and nothing is coming
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # noqa: F841
    base = WrapperStore("127.0.0.1", port, "training/r/cycle0/wrapper")
    if recorded:
        WrapperIterationStore(0, base).record_interrupted([InterruptionRecord(2, Interruption.EXCEPTION)])
    clock = SimpleNamespace(now=0.0, monotonic=lambda: clock.now, sleep=lambda s: setattr(clock, "now", clock.now + s))
    monkeypatch.setattr(inprocess_module, "time", clock)
    reports = []
    inprocess_module._handle_failure(lambda wrapper, err: reports.append(err),
                                     SimpleNamespace(iteration=0, base_store=base),
                                     RuntimeError("Read error [127.0.0.1]:41613: Connection reset by peer"))
    assert len(reports) == 1 and (clock.now >= inprocess_module.PEER_ABORT_WAIT) is waits


# ---- the in-memory rollback ---------------------------------------------------------------------


def _training_state(info, seed=0):
    """A fresh FSDP2 model, optimizer, data stream and RNG, as each restart iteration builds them."""
    cfg = load_train_config(None, ["training.seq_len=16", "training.batch_size=2"])
    torch.manual_seed(seed)
    model, optimizer = build(cfg, model_spec(cfg.model), info)
    # gradients accumulated over two micro-batches, as global_batch_size does
    stream = TokenStream(TrainingConfig(seq_len=16, batch_size=2, seed=7), DataConfig(), rank=0, world_size=1,
                         vocab_size=PRESETS["tiny"].vocab_size, rows=2)
    train = TrainState(stream, RankMonitor(cfg.fault_tolerance, cfg.checkpoint.mode))
    state = {"model": ModelState(model), "optimizer": OptimizerState(model, optimizer), "train": train,
             "rng_rank0": RngState(info.device)}

    optimizer_step = OptimizerStep(model, optimizer, info, grad_clip=1.0)

    def step():
        train.step += 1
        optimizer_step.run(stream.next_step(), lr=1e-3 * train.step)  # lr changes, as in warm-up
        torch.rand(1)  # advance the RNG, as dropout would
    return state, step


def _host(state):
    return {k: copy_into(v.state_dict(), None) for k, v in state.items()}


def test_rollback_restores_the_newest_step_into_a_fresh_build(one_rank_group):
    rollback = MemoryRollback()
    state, step = _training_state(one_rank_group)
    assert rollback.restore(state) is None  # nothing held: the caller loads from disk
    _train_saving(rollback, state, step, (1, 2, 3))
    expected = _host(state)
    assert rollback.steps == [2, 3] and KEEP == 2
    step()  # training goes on, then the fault: the restart builds everything anew
    fresh, step_fresh = _training_state(one_rank_group, seed=1)
    assert rollback.restore(fresh) == 3
    assert fresh["train"].step == 3 and fresh["train"].stream.consumed_samples == 3 * 2 * 2  # 2 micro-batches of 2
    assert_bitwise_equal(_host(fresh), expected)  # model and optimizer shards, data position, RNG
    step_fresh()  # the restored state trains in place: it must not share the snapshot's buffers
    again, _ = _training_state(one_rank_group, seed=2)
    assert rollback.restore(again) == 3
    assert_bitwise_equal(_host(again), expected)


def _buffers(rollback):
    """step -> the addresses of its snapshot's host buffers."""
    def addresses(tree):
        if isinstance(tree, torch.Tensor):
            return [tree.data_ptr()]
        items = tree.values() if isinstance(tree, dict) else tree if isinstance(tree, (list, tuple)) else ()
        return [a for item in items for a in addresses(item)]
    return {s.step: addresses(s.state) for s in rollback._snapshots}


def test_saves_reuse_the_buffers_of_the_snapshot_they_overwrite(one_rank_group):
    rollback = MemoryRollback()
    state, step = _training_state(one_rank_group)
    seen = {}
    for n in (1, 2, 3, 4):
        step()
        rollback.save(n, state)
        seen.update(_buffers(rollback))
    assert seen[3] == seen[1] and seen[4] == seen[2]  # steps 3 and 4 written over 1 and 2
    assert not set(seen[1]) & set(seen[2])  # the two kept steps never share memory
    assert len(seen[1]) > 10  # model and optimizer shards, RNG


def _held(rollback, step):
    """The host copy of `step` the rollback holds."""
    [held] = [s.state for s in rollback._snapshots if s.step == step]
    return held


def _train_saving(rollback, state, step, steps, check=False):
    """`step()` then `rollback.save` for each of `steps`; with `check`, the held copy equals the live state."""
    for n in steps:
        step()
        rollback.save(n, state)
        if check:
            assert_bitwise_equal(_held(rollback, n), _host(state))


def _count_state_dict_calls(monkeypatch, state, keys=("model", "optimizer")):
    calls = []
    for key in keys:
        def counted(real=state[key].state_dict, key=key):
            calls.append(key)
            return real()
        monkeypatch.setattr(state[key], "state_dict", counted)
    return calls


def test_later_saves_copy_model_and_optimizer_without_their_state_dict(one_rank_group, monkeypatch):
    rollback = MemoryRollback()
    state, step = _training_state(one_rank_group)
    calls = _count_state_dict_calls(monkeypatch, state)
    for n in range(1, 6):
        step()
        before = len(calls)
        rollback.save(n, state)
        assert calls[before:] == (["model", "optimizer"] if n <= KEEP else [])  # once per snapshot, for its plan
        assert_bitwise_equal(_held(rollback, n), _host(state))  # and the learning rate of step n


@pytest.mark.parametrize("change", ["replace", "swap", "reorder"])
def test_a_save_follows_optimizer_tensors_replaced_or_moved(one_rank_group, change):
    rollback = MemoryRollback()
    state, step = _training_state(one_rank_group)
    _train_saving(rollback, state, step, (1, 2, 3))  # a plan in each snapshot
    optimizer = state["optimizer"].optimizer
    first = optimizer.param_groups[0]["params"][0]
    moments = optimizer.state[first]
    assert not torch.equal(moments["exp_avg"].to_local(), moments["exp_avg_sq"].to_local())
    if change == "replace":  # as a load does: another tensor, the same shape
        moments["exp_avg"] = moments["exp_avg"] + 1
    elif change == "swap":  # the same tensors at each other's keys
        moments["exp_avg"], moments["exp_avg_sq"] = moments["exp_avg_sq"], moments["exp_avg"]
    else:  # the same tensors at the same keys, listed in another order
        assert list(moments) == ["step", "exp_avg", "exp_avg_sq"]
        optimizer.state[first] = {k: moments[k] for k in ("step", "exp_avg_sq", "exp_avg")}
    for n in (4, 5):  # into each snapshot
        rollback.save(n, state)
        assert_bitwise_equal(_held(rollback, n), _host(state))


def test_restore_then_saves_then_restore(one_rank_group):
    rollback = MemoryRollback()
    state, step = _training_state(one_rank_group)
    _train_saving(rollback, state, step, (1, 2, 3))
    fresh, step_fresh = _training_state(one_rank_group, seed=1)  # the next iteration's objects
    assert rollback.restore(fresh) == 3
    _train_saving(rollback, fresh, step_fresh, (4, 5, 6), check=True)
    assert rollback.restore(fresh) == 6  # into the same objects: the optimizer's load replaces its tensors
    _train_saving(rollback, fresh, step_fresh, (7, 8), check=True)
    expected = _host(fresh)
    again, _ = _training_state(one_rank_group, seed=2)
    assert rollback.restore(again) == 8
    assert_bitwise_equal(_host(again), expected)


def test_plans_keep_no_state_of_a_dead_iteration_alive(one_rank_group):
    rollback = MemoryRollback()
    state, step = _training_state(one_rank_group)
    _train_saving(rollback, state, step, (1, 2, 3))
    optimizer = state["optimizer"].optimizer
    alive = [weakref.ref(t) for t in (*state["model"].live_tensors(), *state["optimizer"].live_tensors())]
    del state, step, optimizer
    gc.collect()
    assert not any(ref() is not None for ref in alive)


class Tensors(Stateful):
    """A Stateful whose state_dict() hands out its live tensors, as a model's does."""

    def __init__(self, **values):
        self.values = values

    def state_dict(self):
        return self.values

    def load_state_dict(self, state):
        self.values = state


def _tensors(n: float, **shapes):
    return {name: torch.full(shape, float(n)) for name, shape in shapes.items()}


SHAPES = {"w": (4, 3), "b": (3,), "m": (5,), "v": (5,)}


def test_a_snapshot_is_a_copy_of_the_live_state():
    rollback, live = MemoryRollback(), Tensors(**_tensors(1, **SHAPES), meta={"name": "x", "n": 1})
    rollback.save(1, {"t": live})
    live.values["w"].add_(5)  # an optimizer step, in place
    live.values["meta"]["n"] = 2
    assert rollback.restore({"t": live}) == 1
    assert torch.equal(live.values["w"], torch.ones(4, 3)) and live.values["meta"] == {"name": "x", "n": 1}


def test_a_changed_structure_gets_new_buffers():
    rollback, live = MemoryRollback(), Tensors(w=torch.ones(4))
    for n in (1, 2):
        live.values["w"].fill_(n)
        rollback.save(n, {"t": live})
    before = _buffers(rollback)
    live.values = {"w": torch.full((6,), 3.0), "exp_avg": torch.full((6,), 3.0)}  # resized, and a new key
    rollback.save(3, {"t": live})
    after = _buffers(rollback)
    assert after[2] == before[2]  # step 2 kept as it was
    assert len(after[3]) == 2 and not set(after[3]) & set(before[1])  # step 1's set rebuilt for step 3
    restored = Tensors(w=torch.zeros(6), exp_avg=torch.zeros(6))
    assert rollback.restore({"t": restored}) == 3
    assert all(torch.equal(v, torch.full((6,), 3.0)) for v in restored.values.values())


class InPlaceTensors(Tensors):
    """Tensors as a training.train.rollback.InPlaceState that lists the values not named in `unlisted`."""

    unlisted: tuple[str, ...] = ()

    def live_tensors(self):
        return [v for k, v in self.values.items() if k not in self.unlisted]

    def refresh(self, saved):
        """Nothing to do: every value is a tensor."""


@pytest.mark.parametrize("change, planned", [
    (lambda values: values["w"].add_(1), True),  # in place: what the plan is for
    (lambda values: values.update(w=values["w"] + 1), False),  # replaced
    (lambda values: values.update(w=torch.ones(6)), False),  # resized
    (lambda values: values.update(w=values["w"].double()), False),  # another dtype
    (lambda values: values.update(exp_avg=torch.ones(2)), False),  # appeared
], ids=["in-place", "replaced", "resized", "dtype", "appeared"])
def test_a_plan_follows_every_change_of_the_live_tensors(change, planned, monkeypatch):
    rollback, live = MemoryRollback(), InPlaceTensors(w=torch.zeros(4), b=torch.zeros(3))
    calls = _count_state_dict_calls(monkeypatch, {"t": live}, keys=("t",))
    for n in (1, 2):  # a plan in each snapshot
        rollback.save(n, {"t": live})
    for n in (3, 4):  # into each snapshot
        change(live.values)
        rollback.save(n, {"t": live})
        held = _held(rollback, n)["t"]
        assert_bitwise_equal(held, live.values)
        assert all(held[k].dtype == v.dtype for k, v in live.values.items())
    assert len(calls) == (2 if planned else 4)


def test_a_tensor_missing_from_the_listing_sends_every_save_through_state_dict(monkeypatch):
    rollback, live = MemoryRollback(), InPlaceTensors(w=torch.zeros(4), b=torch.zeros(3))
    live.unlisted = ("b",)
    calls = _count_state_dict_calls(monkeypatch, {"t": live}, keys=("t",))
    for n in (1, 2, 3, 4):
        live.values["b"].add_(1)
        rollback.save(n, {"t": live})
        assert_bitwise_equal(_held(rollback, n)["t"], live.values)
    assert len(calls) == 4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("cls", [Tensors, InPlaceTensors])
def test_cuda_tensors_are_copied_into_pinned_buffers(cls):
    cuda = {k: v.cuda() for k, v in _tensors(1, **SHAPES).items()}
    rollback, live = MemoryRollback(), cls(**cuda, step=torch.ones(()))  # on the CPU, as AdamW's step counts
    for n in (1, 2, 3, 4):  # the last two by plans, for InPlaceTensors
        for v in live.values.values():
            v.fill_(n)  # on CUDA, queued on the default stream: the save must wait for it
        rollback.save(n, {"t": live})
    held = _held(rollback, 4)["t"]
    assert all(torch.equal(held[k], v.cpu()) and held[k].is_pinned() == v.is_cuda for k, v in live.values.items())


class Interrupt(BaseException):
    """Stands for the Wrapper's asynchronous RankShouldRestart."""


def _interrupt_copy_after(monkeypatch, tensors: int) -> None:
    """The save's copy raises once `tensors` tensors have been copied."""
    real, copied = rollback_module.copy_into, []

    def copy_into(value, buffers, pairs=None):
        if isinstance(value, torch.Tensor):
            if len(copied) == tensors:
                raise Interrupt
            copied.append(value)
        return real(value, buffers, pairs)
    monkeypatch.setattr(rollback_module, "copy_into", copy_into)  # the recursion goes through it too


def test_an_interrupted_save_leaves_the_published_snapshots_restorable(monkeypatch):
    rollback, live = MemoryRollback(), Tensors(**_tensors(0, **SHAPES))
    for n in (1, 2):
        live.values = _tensors(n, **SHAPES)
        rollback.save(n, {"t": live})
    live.values = _tensors(3, **SHAPES)
    with monkeypatch.context() as m:
        _interrupt_copy_after(m, tensors=2)
        with pytest.raises(Interrupt):
            rollback.save(3, {"t": live})
    assert rollback.steps == [2]  # step 1's buffers were being overwritten: not restorable any more
    restored = Tensors(**_tensors(0, **SHAPES))
    assert rollback.restore({"t": restored}) == 2
    assert all(torch.equal(v, torch.full_like(v, 2.0)) for v in restored.values.values())
    rollback.save(3, {"t": live})  # the next save completes into the same buffers
    assert rollback.steps == [2, 3]


def test_an_interrupted_planned_save_leaves_the_published_snapshots_restorable(monkeypatch):
    rollback, live = MemoryRollback(), InPlaceTensors(**_tensors(0, **SHAPES))
    calls = _count_state_dict_calls(monkeypatch, {"t": live}, keys=("t",))

    def fill(n):
        for v in live.values.values():
            v.fill_(n)
    for n in (1, 2, 3):
        fill(n)
        rollback.save(n, {"t": live})  # plans in both snapshots
    fill(4)

    def interrupted(buffers, sources, non_blocking):
        buffers[0].copy_(sources[0])
        raise Interrupt
    with monkeypatch.context() as m:
        m.setattr(torch, "_foreach_copy_", interrupted)
        with pytest.raises(Interrupt):
            rollback.save(4, {"t": live})
    assert rollback.steps == [3]  # step 2's buffers were being overwritten
    assert all(torch.equal(v, torch.full_like(v, 3.0)) for v in _held(rollback, 3)["t"].values())
    rollback.save(4, {"t": live})  # the next save completes into the same buffers, by the same plan
    assert rollback.steps == [3, 4] and len(calls) == KEEP
    assert_bitwise_equal(_held(rollback, 4)["t"], live.values)


def test_a_restore_to_the_older_step_keeps_it_until_a_new_step_is_complete(one_rank_group, monkeypatch):
    rollback, live = MemoryRollback(), Tensors(**_tensors(0, **SHAPES))
    for n in (1, 2, 3):
        live.values = _tensors(n, **SHAPES)
        rollback.save(n, {"t": live})
    # a peer failed before completing step 3: every rank agrees on step 2
    monkeypatch.setattr(rollback_module, "least", lambda *values, group=None: [min(v, 2) for v in values])
    assert rollback.restore({"t": live}) == 2
    assert rollback.steps == [2]  # step 3 is gone back on
    live.values = _tensors(30, **SHAPES)  # step 3 again, another way
    _interrupt_copy_after(monkeypatch, tensors=1)
    with pytest.raises(Interrupt):
        rollback.save(3, {"t": live})
    assert rollback.restore({"t": live}) == 2  # the agreed step survived the interrupted save
    assert all(torch.equal(v, torch.full_like(v, 2.0)) for v in live.values.values())


# ---- runs in the local cluster ------------------------------------------------------------------

STEPS, INTERVAL, GLOO_TIMEOUT_S = 20, 5, 30
COMMON = ("--steps", str(STEPS), f"checkpoint.interval={INTERVAL}", "checkpoint.mode=sync",
          "checkpoint.save_final=true", "logging.log_interval=10", f"training.collective_timeout_s={GLOO_TIMEOUT_S}",
          "fault_tolerance.timeout_safety_factor=50",  # calculated hang timeouts stay loose on 2 busy cores
          "fault_tolerance.inprocess_soft_timeout=4", "fault_tolerance.inprocess_hard_timeout=15",
          "training.batch_size=2", "training.global_batch_size=8")  # 2 ranks x 2 micro-batches of 2
# The fault run's shape is training_helpers.COMMON's: its uninterrupted run is conftest's `reference` (the
# Wrapper's timeouts above change no arithmetic). One run on two nodes (two launchers, one host, so the stores
# must not collide): rank 1 raises, then hangs, each restarted in-process from memory at the last completed
# step; then its process is killed, which no Wrapper survives: an in-job restart from the checkpoint.
FAULTS = {"exception": 4, "hang": 9, "sigkill": 14}
RESUMED = {"exception": (3, "memory"), "hang": (8, "memory"), "sigkill": (10, "disk")}
# An exception is attributed to its rank; a hang to whichever ranks stopped making progress first: the
# hung rank and the peers stuck in a collective with it stop together, and the Wrapper cannot tell them apart.
WRAPPER_RECORDS = {"exception": "rank 1: EXCEPTION", "hang": ": SOFT_TIMEOUT"}


@pytest.fixture(scope="module")
def faults_run(tmp_path_factory):
    spec = ",".join(f"{kind}@{step}:rank=1" for kind, step in FAULTS.items())
    return completed(run_local(tmp_path_factory.mktemp("faults") / "run", *TWO_NODES.argv(), *COMMON,
                               "fault_tolerance.restart=both", "--faults", spec))


def _attempt_kinds(run):
    return [e["restart_kind"] for e in events_named(run.run_dir, "attempt_start")]


def _resumes(run):
    return [(e["step"], e["source_kind"]) for e in events_named(run.run_dir, "resume")]


def _launcher_restarts(run) -> list[float]:
    """When a launcher restarted its workers (ft_launcher's log lines, in this machine's local time)."""
    return [datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            for path in sorted((run.run_dir / "logs").glob("node*.log"))
            for line in path.read_text().splitlines() if "will restart worker group" in line]


def _detected_after(run, kind: str) -> list[dict]:
    """The detections from the injection of `kind` to the next fault's."""
    injected = sorted(e["t"] for e in events_named(run.run_dir, "fault_injected"))
    start = next(e["t"] for e in events_named(run.run_dir, "fault_injected") if e["kind"] == kind)
    end = min((t for t in injected if t > start), default=math.inf)
    return [e for e in events_named(run.run_dir, "fault_detected") if start <= e["t"] < end]


@pytest.mark.slow
def test_faults_restart_every_rank_in_process_from_memory_and_a_killed_process_from_disk(faults_run, reference,
                                                                                          scratch):
    run = faults_run
    assert _attempt_kinds(run) == ["fresh", "inprocess", "inprocess", "injob"]  # a new process has no memory
    assert _resumes(run) == [(0, "none"), *RESUMED.values()]  # the last completed step, or the checkpoint
    faults = build_report(read_events(run.run_dir)).faults
    assert [(f.kind, f.rank, f.restart_kind, f.resumed_from) for f in faults] == [
        (kind, 1, "inprocess" if source == "memory" else "injob", step) for kind, (step, source) in RESUMED.items()]
    # same processes: no launcher restarted its workers before the killed process
    [killed] = [e["t"] for e in events_named(run.run_dir, "fault_injected") if e["kind"] == "sigkill"]
    restarts = _launcher_restarts(run)
    assert restarts and min(restarts) > killed - 1, restarts  # the log's clock is read to the millisecond
    for fault in faults[:2]:
        detected = [e for e in _detected_after(run, fault.kind) if e["by"].startswith("inprocess wrapper")]
        assert any(WRAPPER_RECORDS[fault.kind] in e["detail"] for e in detected)  # its interruption records
        if fault.kind == "exception":
            assert {e["rank"] for e in detected} == {1}
        assert fault.steps_lost is not None and fault.steps_lost <= 1
        assert fault.detection_s is not None and fault.detection_s < GLOO_TIMEOUT_S  # the Wrapper, not gloo
        assert math.isfinite(fault.recovery_s) and 0 < fault.recovery_s < GLOO_TIMEOUT_S
    # the survivor's Wrapper saw its collective fail with the killed process: it must not blame itself
    assert all(e["rank"] in (None, 1) for e in _detected_after(run, "sigkill"))
    assert faults[2].recovery_s is not None
    # model, optimizer, data position and RNG rolled back exactly
    assert_bitwise_equal(load_final_state(run.run_dir, scratch), load_final_state(reference.run_dir, scratch))


@pytest.mark.slow
def test_persistent_fault_ends_the_job_after_the_inprocess_budget_naming_rank_and_fault(tmp_path):
    spec, budget = "exception@3:rank=1:persistent", 2
    started = time.monotonic()
    # no in-job restart (max_restarts=0) and --node-retries 0: the Wrapper's budget alone is measured
    run = run_local(tmp_path / "run", *replace(ONE_NODE, node_retries=0).argv(), *COMMON,
                    "fault_tolerance.restart=both", "fault_tolerance.max_restarts=0",
                    f"fault_tolerance.inprocess_max_restarts={budget}", "--faults", spec, timeout=180)
    assert run.returncode == 1, run.output[-4000:]
    assert time.monotonic() - started < 150
    # the first restart follows progress (steps 1-2 kept in memory); then `budget` restarts without
    injected = events_named(run.run_dir, "fault_injected")
    assert len(injected) == budget + 2 and {e["step"] for e in injected} == {3}  # once per iteration
    # ... and no attempt of the iteration that finds the budget spent as it starts
    assert _attempt_kinds(run) == ["fresh"] + ["inprocess"] * (budget + 1)
    message = (f"{budget + 1} in-process restarts in a row made no progress (budget {budget}, "
               f"fault_tolerance.inprocess_max_restarts); the last failed with: rank 1: FaultInjected: "
               f"injected fault {spec}")
    assert message in run.output  # rank 0's log line, echoed by the controller
    assert [e["status"] for e in events_named(run.run_dir, "run_end")] == ["failed"]
