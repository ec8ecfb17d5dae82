"""Async saves' staging on CPU (training/train/checkpoint/staging.py): buffers allocated ahead, off the training
thread, and reused by every save; each copy made while training goes on, until the state changes; each save
holding its own step's values."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from training.contract.events import EventLog, read_events
from training.train.checkpoint import staging as staging_module
from training.train.checkpoint.staging import SharedStaging
from training_helpers import checkpoint_manager

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _state(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((1 << 16,), value), "m": torch.full((1 << 10,), -value)}


def test_after_a_warm_up_a_save_allocates_nothing_and_stages_its_own_values(monkeypatch):
    state = _state(1.0)
    staging = SharedStaging()
    staging.warm_up(state)
    staging.wait()
    allocated = []
    real_new_shared = staging_module.new_shared_buffer
    monkeypatch.setattr(staging_module, "new_shared_buffer", lambda *a: allocated.append(a) or real_new_shared(*a))
    state["w"].fill_(2.0)  # trained on after the warm-up
    staged = staging.stage(state).result()
    assert allocated == []
    assert torch.equal(staged["w"], state["w"]) and torch.equal(staged["m"], state["m"])
    assert staged["w"].untyped_storage().is_shared()  # the writer process maps it where it is
    state["w"].fill_(3.0)  # training goes on: the staged copy keeps the step it was taken at
    assert torch.equal(staged["w"], torch.full((1 << 16,), 2.0))
    staging.close()


def test_the_warm_up_lets_the_training_thread_run():
    """Allocating a buffer page-faults it in (about a second for 256 MiB here); a copy holding the GIL would
    stop the training loop's Python as long."""
    state = {"w": torch.ones(64 << 20)}  # 256 MiB
    staging = SharedStaging()
    started = time.perf_counter()
    warming = staging.warm_up(state)
    longest_gap, last = 0.0, time.perf_counter()
    while not warming.done():
        now = time.perf_counter()
        longest_gap, last = max(longest_gap, now - last), now
    took = time.perf_counter() - started
    staging.close()
    assert longest_gap < took / 2, (longest_gap, took)


def test_a_prepared_async_save_holds_the_step_it_was_saved_at(tmp_path):
    m = checkpoint_manager(tmp_path / "ckpt", mode="async", keep=2, events=EventLog(tmp_path, "rank0"))
    state = _state(1.0)
    m.prepare(state)
    m.prepare(_state(9.0))  # once: later calls do nothing
    m.wait_for_writer()
    state["w"].fill_(2.0)
    m.save(2, state)
    m.wait_staged()  # before the optimizer's step, as OptimizerStep.run does
    state["w"].fill_(3.0)  # the next steps, while the save is written
    m.wait()
    target = _state(0.0)
    assert m.load(target).step == 2 and torch.equal(target["w"], torch.full((1 << 16,), 2.0))
    m.close()


def test_an_async_save_returns_before_its_copy_is_made_and_the_state_waits_for_it(tmp_path, monkeypatch):
    release = threading.Event()
    copy = staging_module._GilFreeStager._stage_untyped_storage

    def held_copy(self, storage, non_blocking=False):  # a copy that takes its time (a large state)
        release.wait(30)
        return copy(self, storage, non_blocking)

    monkeypatch.setattr(staging_module._GilFreeStager, "_stage_untyped_storage", held_copy)
    m = checkpoint_manager(tmp_path / "ckpt", mode="async", keep=2, events=EventLog(tmp_path, "rank0"))
    state = _state(2.0)
    m.save(2, state)  # returns with its copy held: the next step's forward and backward run meanwhile
    assert [e["event"] for e in read_events(tmp_path)] == ["ckpt_start"]
    threading.Timer(0.3, release.set).start()
    m.wait_staged()  # before the optimizer's step, as OptimizerStep.run does
    blocked = [e for e in read_events(tmp_path) if e["event"] == "ckpt_blocked"]
    assert len(blocked) == 1 and blocked[0]["step"] == 2 and blocked[0]["seconds"] >= 0.25  # the wait counts
    state["w"].fill_(3.0)  # the optimizer's step
    m.wait()
    target = _state(0.0)
    assert m.load(target).step == 2 and torch.equal(target["w"], torch.full((1 << 16,), 2.0))
    assert [e["event"] for e in read_events(tmp_path)].count("ckpt_blocked") == 1
    m.close()


def test_an_aborted_save_returns_at_once_and_still_says_how_long_it_blocked(tmp_path, monkeypatch):
    release = threading.Event()
    copy = staging_module._GilFreeStager._stage_untyped_storage

    def held_copy(self, storage, non_blocking=False):
        release.wait(30)
        return copy(self, storage, non_blocking)

    monkeypatch.setattr(staging_module._GilFreeStager, "_stage_untyped_storage", held_copy)
    m = checkpoint_manager(tmp_path / "ckpt", mode="async", keep=2, events=EventLog(tmp_path, "rank0"))
    m.save(2, _state(2.0))
    started = time.monotonic()
    m.abort()  # the next step died before its optimizer step (an in-process restart): the copy is not waited for
    assert time.monotonic() - started < 5
    assert [e["event"] for e in read_events(tmp_path)] == ["ckpt_start", "ckpt_blocked"]
    release.set()


def test_a_copy_views_each_storage_on_its_own_device():
    """A CUDA state (the torch writer where NVRx is missing) is copied to host buffers from views on its device."""
    storage = torch.UntypedStorage(8, device="meta")
    assert staging_module._as_bytes(storage).device == storage.device
