"""The staging buffers of an async save on CPU: the rank's state copied into shared memory that is allocated
once, ahead of the first save and off the training thread, and reused by every save; each copy made in a
thread of its own while the training thread goes on to the next step, until it changes the state.

Why not torch's DefaultStager(use_shared_memory) (torch.distributed.checkpoint._state_dict_stager
.StateDictStager, torch 2.13), which also reuses one buffer per source storage: its first save allocates and
page-faults every buffer on the training thread, every save copies there, and its copies
(UntypedStorage.copy_) hold the GIL, so they cannot move into a thread either. `SharedStaging` copies with
Tensor.copy_, which releases the GIL, in its own thread (`warm_up`, then `stage`, which returns the Future DCP
gives as staging_completion). Cost: a thread and a spare copy of the rank's state in shared memory; the
training thread waits only before the optimizer's step (CheckpointManager.wait_staged). docs/training.md,
"Async saves".
"""
from __future__ import annotations

from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed.checkpoint._state_dict_stager import StateDictStager
from torch.distributed.checkpoint.staging import AsyncStager
from torch.utils._pytree import tree_leaves

from training.train.checkpoint.shm_budget import check_fd_budget, new_shared_buffer, raise_fd_limit

# Storages smaller than this are staged in private memory and travel pickled in the save's request: copying them
# through the socket costs microseconds, a buffer of their own a descriptor in the rank and two in the writer
# (shm_budget). Norm weights, biases, AdamW's step counters and RNG states: about a quarter of a Llama state's
# tensors, nothing of its bytes.
BY_VALUE_BYTES = 64 << 10


def _as_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class _GilFreeStager(StateDictStager):
    """StateDictStager (shared memory, a buffer per source storage, reused) whose copies release the GIL."""

    def __init__(self) -> None:
        super().__init__(pin_memory=False, share_memory=True)

    def _stage_untyped_storage(self, storage: torch.UntypedStorage, non_blocking: bool = False) -> torch.UntypedStorage:
        staged = self._cached_storage_mapping.get(storage)
        if staged is None or staged.nbytes() != storage.nbytes():
            # a small one goes to the writer by value inside the request (shm_channel): not worth a descriptor
            shared = storage.nbytes() >= BY_VALUE_BYTES
            staged = new_shared_buffer(storage.nbytes()) if shared else torch.UntypedStorage(storage.nbytes())
            self._cached_storage_mapping[storage] = staged  # keyed weakly: gone with its source storage
        _as_bytes(staged).copy_(_as_bytes(storage))  # a tensor op: the GIL is released while it copies
        return staged


def _shared_buffers(state_dict: dict[str, Any]) -> int:
    """The shared-memory buffers staging `state_dict` takes: one per distinct storage of its tensors (DTensors'
    local ones) of at least BY_VALUE_BYTES."""
    tensors = [getattr(t, "_local_tensor", t) for t in tree_leaves(state_dict) if isinstance(t, torch.Tensor)]
    storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}
    return sum(nbytes >= BY_VALUE_BYTES for nbytes in storages.values())


class SharedStaging(AsyncStager):
    """dcp.async_save's stager: staging into reused shared-memory buffers, in a thread of its own, whose buffers
    `warm_up` allocates ahead. One save at a time (CheckpointManager keeps at most one in flight)."""

    _synchronize_after_execute = False  # the caller waits for the staging Future where it must (wait_staged)

    def __init__(self) -> None:
        raise_fd_limit()  # the rank holds a descriptor per buffer (shm_budget)
        self._stager = _GilFreeStager()
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-staging")
        self._last: Future[Any] | None = None

    def warm_up(self, state_dict: dict[str, Any]) -> Future[Any]:
        """Allocate and touch the buffers for `state_dict` in the staging thread; returns at once. A state with
        more buffers than the writer process can receive is refused here (StagingBudgetError)."""
        check_fd_budget(_shared_buffers(state_dict))
        self._last = self._thread.submit(self._stager.stage, state_dict)
        return self._last

    def stage(self, state_dict: dict[str, Any]) -> Future[dict[str, Any]]:
        """The staged copy of `state_dict`, made in the staging thread. A warm-up still running is waited for
        here, in the save's own time, so that what the training thread waits for later is the copy alone."""
        self.wait()
        self._last = self._thread.submit(self._stager.stage, state_dict)
        return self._last

    def wait(self) -> None:
        """Block until the last warm-up or copy has ended (a failed copy fails its save: the save reports it)."""
        if self._last is not None:
            futures.wait([self._last])

    def synchronize_staging(self) -> None:
        self.wait()

    def close(self, wait: bool = True) -> None:
        """Free the buffers. wait=False (the run dies): return at once; a copy under way (a warm-up can take
        seconds) ends in the thread, and the buffers are freed after it."""
        self._thread.shutdown(wait=wait, cancel_futures=True)
        if wait or self._last is None or self._last.done():
            self._stager.close()
        else:
            self._last.add_done_callback(lambda _: self._stager.close())
