"""The recovery tiers' one contract (training/train/recovery.py), without processes: stand-in tiers and
stand-ins for what the adapters wrap."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from training.train.checkpoint.manager import Loaded
from training.train.recovery import (DiskTier, InProcessTier, LiveGroupTier, PeerTier, Restored, SourceKind,
                                     restore_first)


@dataclass
class FakeTier:
    holds: int | None  # the step it holds; None: nothing
    asked: list[str]  # the names of the tiers asked, in order, shared by all
    name: ClassVar[SourceKind] = "peer"
    loaded_into: list[dict[str, Any]] = field(default_factory=list)

    def restore(self, state: dict[str, Any], *, not_older_than: int) -> Restored | None:
        self.asked.append(f"{self.holds}>={not_older_than}")
        if self.holds is None:
            return None
        state["step"] = self.holds
        return Restored(self.holds, self.name)

    def superseded(self, restored: Restored | None) -> None:
        self.asked.append(f"{self.holds} superseded by {restored and restored.step}")


def test_restore_first_asks_in_order_and_the_first_that_restores_wins():
    asked: list[str] = []
    tiers = [FakeTier(None, asked), FakeTier(7, asked), FakeTier(9, asked)]
    state: dict[str, Any] = {}
    assert restore_first(tiers, state, not_older_than=5) == Restored(7, "peer")
    assert asked == ["None>=5", "7>=5", "None superseded by 7"]  # the third tier is never asked; the first told
    assert state == {"step": 7}


def test_restore_first_is_none_when_every_tier_misses():
    asked: list[str] = []
    state: dict[str, Any] = {}
    assert restore_first([FakeTier(None, asked), FakeTier(None, asked)], state, not_older_than=0) is None
    assert asked == ["None>=0", "None>=0", "None superseded by None", "None superseded by None"] and state == {}
    assert restore_first([], state, not_older_than=0) is None  # no tier at all: a fresh start


@dataclass
class BoundedTier(FakeTier):
    """A tier that, as peer state, declines a copy older than the bound."""

    def restore(self, state: dict[str, Any], *, not_older_than: int) -> Restored | None:
        if self.holds is not None and self.holds < not_older_than:
            self.asked.append(f"{self.holds}>={not_older_than}: declined")
            return None
        return super().restore(state, not_older_than=not_older_than)


def test_a_damaged_newest_checkpoint_does_not_cost_a_newer_copy_in_memory():
    """Peer state holds step 9 and declines it for the committed checkpoint 10; checkpoint 10 is damaged and
    the disk tier loads 5: step 9 from peers is newer than what loaded, so it is loaded instead, not discarded."""
    asked: list[str] = []
    peer, disk = BoundedTier(9, asked), FakeTier(5, asked)
    state: dict[str, Any] = {}
    assert restore_first([peer, disk], state, not_older_than=10) == Restored(9, "peer")
    assert asked == ["9>=10: declined", "5>=10", "9>=6"] and state == {"step": 9}
    asked.clear()
    stale = BoundedTier(4, asked)  # older than what loaded: told and discarded as before
    assert restore_first([stale, FakeTier(5, asked)], {}, not_older_than=10) == Restored(5, "peer")
    assert asked == ["4>=10: declined", "5>=10", "4>=6: declined", "4 superseded by 5"]


class _Holds:
    """Stands in for an Iteration or a PeerState: restores `step` (or nothing) and records the bound."""

    def __init__(self, step: int | None) -> None:
        self.step, self.bounds = step, []

    def restore(self, state: dict[str, Any], not_older_than: int | None = None) -> int | None:
        self.bounds.append(not_older_than)
        return self.step


def test_memory_tiers_say_which_memory_and_only_peer_state_is_bounded():
    iteration, peer = _Holds(4), _Holds(None)
    assert InProcessTier(iteration).restore({}, not_older_than=3) == Restored(4, "memory")  # type: ignore[arg-type]
    assert iteration.bounds == [None]  # every step is kept in process memory: no checkpoint is newer
    assert PeerTier(peer).restore({}, not_older_than=3) is None  # type: ignore[arg-type]
    assert peer.bounds == [3]
    assert Restored(4, "memory").origin == "process memory" and Restored(4, "peer").origin == "node memory"


class _Checkpoints:
    def __init__(self, loaded: Loaded | None) -> None:
        self.loaded, self.calls = loaded, []

    def load(self, state: dict[str, Any], *, optional: frozenset[str], allow_fresh_start: bool) -> Loaded | None:
        self.calls.append((optional, allow_fresh_start))
        return self.loaded


def test_disk_tier_reports_the_checkpoint_and_what_it_lacked():
    path = Path("/ckpt/step_00000006")
    ckpt = _Checkpoints(Loaded(step=6, path=path, world_size=2, missing=("rng_rank3",)))
    tier = DiskTier(ckpt, optional=frozenset({"rng_rank3"}), allow_fresh_start=False)  # type: ignore[arg-type]
    restored = tier.restore({}, not_older_than=0)
    assert restored == Restored(6, "disk", path, saved_world_size=2, missing=("rng_rank3",))
    assert restored.origin == str(path)
    assert ckpt.calls == [(frozenset({"rng_rank3"}), False)]
    assert DiskTier(_Checkpoints(None), frozenset(), True).restore({}, not_older_than=0) is None  # type: ignore[arg-type]


class _Groups:
    """Stands in for ReplicaGroups: its first quorum heals it to `live` (None: no group ahead of it)."""

    def __init__(self, live: int | None) -> None:
        self.live, self.calls = live, []

    def heal(self) -> int | None:
        self.calls.append("heal")
        return self.live

    def resumed_at(self, step: int) -> None:
        self.calls.append(f"resumed at {step}")


def test_the_live_tier_heals_before_the_disk_is_read_and_otherwise_reports_what_the_disk_loaded():
    """A restarted replica group with a live group to heal from reads no checkpoint; with none (every group
    lost), the disk tier loads and the group reports that step to its next quorum. Asked once: a second
    quorum would take a step the live groups train without it."""
    asked: list[str] = []
    healing, joined = _Groups(live=40), []
    tier = LiveGroupTier(lambda step: joined.append(step) or healing)  # type: ignore[arg-type,return-value]
    disk = FakeTier(30, asked)
    assert restore_first([tier, disk], {}, not_older_than=0) == Restored(40, "live")
    assert asked == [] and joined == [0] and healing.calls == ["heal"]  # the disk tier was never asked
    assert Restored(40, "live").origin == "a live replica group"

    alone = _Groups(live=None)
    tier = LiveGroupTier(lambda step: alone)  # type: ignore[arg-type,return-value]
    assert restore_first([tier, BoundedTier(30, asked)], {}, not_older_than=0) == Restored(30, "peer")
    assert alone.calls == ["heal", "resumed at 30"]
    assert tier.restore({}, not_older_than=31) is None and alone.calls == ["heal", "resumed at 30"]  # asked again
