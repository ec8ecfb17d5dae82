"""The staging buffers of an async save on CPU: the rank's state copied into shared memory that is allocated
once, ahead of the first save and off the training thread, and reused by every save.

A save copies the state (its staging copy) and returns; the writer process then reads the copy where it lies
(writer_process.py). torch's DefaultStager(use_shared_memory) already keeps one buffer per source storage and
reuses it (torch.distributed.checkpoint._state_dict_stager.StateDictStager, torch 2.13), but two things in it
cost the training thread: the first save allocates and page-faults every buffer (1.3-2.7 s for 512 MiB on
this VM: the kernel zero-fills each new shared-memory page), and its copies (UntypedStorage.copy_) hold the
GIL, so that allocation cannot move into a thread without stopping the training loop's Python as long.

`SharedStaging` copies with Tensor.copy_, which releases the GIL, and `warm_up(state)` runs a first staging
in a thread: the buffers are allocated and touched while training goes on (on a spare core, for nothing),
and the first save only copies. A save waits for a warm-up still running (DefaultStager is not thread-safe,
and neither is this). What the warm-up copies is thrown away: each save copies the state of its own step.
"""
from __future__ import annotations

import threading
from typing import Any

import torch
from torch.distributed.checkpoint._state_dict_stager import StateDictStager
from torch.distributed.checkpoint.staging import AsyncStager


def _as_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(storage)


class _GilFreeStager(StateDictStager):
    """StateDictStager (shared memory, a buffer per source storage, reused) whose copies release the GIL."""

    def __init__(self) -> None:
        super().__init__(pin_memory=False, share_memory=True)

    def _stage_untyped_storage(self, storage: torch.UntypedStorage, non_blocking: bool = False) -> torch.UntypedStorage:
        staged = self._cached_storage_mapping.get(storage)
        if staged is None or staged.nbytes() != storage.nbytes():
            staged = torch.UntypedStorage._new_shared(storage.nbytes(), device="cpu")
            self._cached_storage_mapping[storage] = staged  # keyed weakly: gone with its source storage
        _as_bytes(staged).copy_(_as_bytes(storage))  # a tensor op: the GIL is released while it copies
        return staged


class SharedStaging(AsyncStager):
    """dcp.async_save's stager: synchronous staging into reused shared-memory buffers, allocated ahead by
    `warm_up`. Not thread-safe: one save at a time (CheckpointManager keeps at most one in flight)."""

    _synchronize_after_execute = False  # staging is done when `stage` returns

    def __init__(self) -> None:
        self._stager = _GilFreeStager()
        self._warming: threading.Thread | None = None

    def warm_up(self, state_dict: dict[str, Any]) -> None:
        """Allocate and touch the buffers for `state_dict` in a background thread (returns at once)."""
        self.wait_warm()
        self._warming = threading.Thread(target=self._stager.stage, args=(state_dict,), name="ckpt-staging-warm-up",
                                         daemon=True)
        self._warming.start()

    def wait_warm(self) -> None:
        """Block until a warm-up still running has finished."""
        if self._warming is not None:
            self._warming.join()
            self._warming = None

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        self.wait_warm()
        return self._stager.stage(state_dict)

    def synchronize_staging(self) -> None:
        """Nothing: `stage` returns once the copy is made."""

    def close(self) -> None:
        self.wait_warm()
        self._stager.close()
