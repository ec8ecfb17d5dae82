"""The recovery tiers behind one contract: where a restarted rank finds its training state.

A tier loads the newest state it holds into the Stateful dict and says what it loaded (`Restored`), or
leaves the dict untouched and returns None. `restore_first` asks the tiers fastest first (`InProcessTier`,
`PeerTier`, `LiveGroupTier`, `DiskTier`) and the first that restores wins. Every tier is collective and its
answer the same on every rank, so every rank walks the list alike. Cost: a tier with nothing to give keeps its
copies until another tier's load has succeeded (`RecoveryTier.superseded`): a checkpoint that fails to load
must not have cost them.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Literal, Protocol

if TYPE_CHECKING:
    from torch.distributed.checkpoint.stateful import Stateful

    from training.train.checkpoint.manager import CheckpointManager
    from training.train.inprocess import Iteration
    from training.train.peer_state import PeerState
    from training.train.replica_groups import ReplicaGroups

# the `resume` event's source_kind (training.contract.events)
SourceKind = Literal["memory", "peer", "live", "disk"]


@dataclass(frozen=True)
class Restored:
    """What a tier loaded: the step, the tier, and what the disk tier knows of the checkpoint."""
    step: int
    source_kind: SourceKind
    path: Path | None = None  # the checkpoint loaded
    saved_world_size: int | None = None  # the world size that wrote it (None: not recorded)
    missing: tuple[str, ...] = ()  # optional keys it lacks: per-rank state of ranks it was not written by

    @property
    def origin(self) -> str:
        """Where the state came from, as the resume log line says it."""
        return str(self.path) if self.path is not None else _MEMORY_ORIGIN[self.source_kind]


_MEMORY_ORIGIN = {"memory": "process memory", "peer": "node memory", "live": "a live replica group"}


class RecoveryTier(Protocol):
    """One place a restarted rank may find its state. Collective: its answer is the same on every rank."""
    name: ClassVar[SourceKind]

    def restore(self, state: dict[str, Stateful], *, not_older_than: int) -> Restored | None:
        """Load this tier's newest state into `state` (collective); None, and `state` untouched, when
        it holds none. `not_older_than`: the newest committed checkpoint's step, which a copy kept
        apart from the checkpoints must not be older than."""
        ...

    def superseded(self, restored: Restored | None) -> None:
        """After this tier returned None: a later tier's state was loaded (None: a fresh start). Called
        only once that load succeeded: a checkpoint that fails to load must not have cost this tier's copies."""
        ...


@dataclass(frozen=True)
class InProcessTier:
    """The `memory` tier, asked first: after an in-process restart, the host copy of the last step every
    rank completed (training.train.rollback, through the Wrapper's Iteration; training.train.inprocess).
    Never older than a checkpoint: every step is kept."""
    iteration: Iteration
    name: ClassVar[SourceKind] = "memory"

    def restore(self, state: dict[str, Stateful], *, not_older_than: int) -> Restored | None:
        step = self.iteration.restore(state)
        return None if step is None else Restored(step, self.name)

    def superseded(self, restored: Restored | None) -> None:
        pass  # the Wrapper's next iteration replaces the host copy


@dataclass(frozen=True)
class PeerTier:
    """The `peer` tier, asked second: the copies in node memory of this and the partner nodes
    (training.train.peer_state), if they hold every shard of a step no older than the newest checkpoint."""
    peer: PeerState
    name: ClassVar[SourceKind] = "peer"

    def restore(self, state: dict[str, Stateful], *, not_older_than: int) -> Restored | None:
        step = self.peer.restore(state, not_older_than=not_older_than)
        return None if step is None else Restored(step, self.name)

    def superseded(self, restored: Restored | None) -> None:
        self.peer.discard()


@dataclass
class LiveGroupTier:
    """The `live` tier, with replica groups, asked before the disk: a live group's state, sent by torchft's
    heal in this group's first quorum (ReplicaGroups.heal), so that a restarted group reads no checkpoint
    while another group trains. None where no group is ahead (every group lost, or a fresh start): the disk
    tier loads, and the group reports that step (`superseded`). Asked once: the quorum it forms is the next
    step's. Not asked where an earlier tier restored; then the first step's quorum heals a group behind."""
    join: Callable[[int], ReplicaGroups]  # this rank's ReplicaGroups, reporting a step (0: nothing loaded)
    replicas: ReplicaGroups | None = None
    name: ClassVar[SourceKind] = "live"

    def restore(self, state: dict[str, Stateful], *, not_older_than: int) -> Restored | None:
        if self.replicas is not None:  # asked again by restore_first: its quorum is formed already
            return None
        self.replicas = self.join(0)  # a heal loads into the state the ReplicaGroups hold: `state`
        step = self.replicas.heal()
        return None if step is None else Restored(step, self.name)

    def superseded(self, restored: Restored | None) -> None:
        assert self.replicas is not None
        self.replicas.resumed_at(restored.step if restored is not None else 0)


@dataclass(frozen=True)
class DiskTier:
    """The `disk` tier, asked last: the newest loadable checkpoint, resharded to this world size
    (training.train.checkpoint). With `allow_fresh_start` False, committed checkpoints of which none loads
    raise FreshStartRefused rather than returning None."""
    ckpt: CheckpointManager
    optional: frozenset[str]  # per-rank keys a checkpoint written at another world size may lack
    allow_fresh_start: bool
    name: ClassVar[SourceKind] = "disk"

    def restore(self, state: dict[str, Stateful], *, not_older_than: int) -> Restored | None:
        loaded = self.ckpt.load(state, optional=self.optional, allow_fresh_start=self.allow_fresh_start)
        if loaded is None:
            return None
        return Restored(loaded.step, self.name, loaded.path, loaded.world_size, loaded.missing)

    def superseded(self, restored: Restored | None) -> None:
        pass  # the last tier: nothing comes after it


def restore_first(tiers: Sequence[RecoveryTier], state: dict[str, Stateful], not_older_than: int) -> Restored | None:
    """The first tier's result that is not None, the tiers after it not asked; None: a fresh start. The
    tiers asked before it are told, once it is loaded (a load that raises tells them nothing).

    Where what loaded is older than `not_older_than` (the newest checkpoint was damaged and the disk tier
    fell back to an older one), a tier that declined a copy for being older than that checkpoint may hold
    a newer state than the one loaded: the tiers before are asked once more, bounded by what loaded."""
    restored, asked = _first(tiers, state, not_older_than)
    if restored is not None and restored.step < not_older_than and asked > 0:
        newer, asked_again = _first(tiers[:asked], state, restored.step + 1)
        if newer is not None:
            restored, asked = newer, asked_again
    for tier in tiers[:asked]:
        tier.superseded(restored)
    return restored


def _first(tiers: Sequence[RecoveryTier], state: dict[str, Stateful], not_older_than: int) -> tuple[Restored | None, int]:
    """The first result that is not None and the index of its tier (len(tiers) when none restored)."""
    for index, tier in enumerate(tiers):
        if (restored := tier.restore(state, not_older_than=not_older_than)) is not None:
            return restored, index
    return None, len(tiers)
