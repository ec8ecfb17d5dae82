"""The capacity model (training/contract/capacity.py) against figures worked out by hand from its sources."""
from __future__ import annotations

import dataclasses
import math
import re

import pytest

from training.contract.capacity import (ASYNC_SAVE_HEADROOM, CRC32_GBS, P5_48XLARGE, FsxSpec, HsdpCase, ModelFootprint,
                                        Schedule, capacity_of, format_capacity, gradient_reduce, smallest_storage_gib)
from training.contract.config import load_train_config
from training.train.drain import IMPOSSIBLE, DrainView, checkpoint_cost, plan_drain

EIGHT_B = ModelFootprint.from_preset("8b", 4096)
JOB = Schedule(interval=200, keep=3, mode="async", drain_timeout_s=360, peer_state=True)  # k8s/train.yaml's
# 8 192 tokens x 51 471 998 976 FLOPs per token on a 989 TFLOPs GPU at 40% MFU
STEP_8B = 8192 * 51_471_998_976 / (989e12 * 0.40)


def test_8b_state_and_projected_step() -> None:
    assert EIGHT_B.parameters == 8_030_261_248
    assert EIGHT_B.state_bytes == 96_363_134_976  # fp32 weights and two AdamW moments: 12 B per parameter
    c = capacity_of(EIGHT_B, P5_48XLARGE, 2, FsxSpec(1200, 1000), JOB)
    assert c.step_s == pytest.approx(STEP_8B) and c.step_s == pytest.approx(1.066, abs=1e-3)
    assert c.node_bytes == pytest.approx(48.18e9, rel=1e-3) and c.gpu_bytes == pytest.approx(6.02e9, rel=1e-3)


def test_a_step_projects_its_whole_global_batch() -> None:
    """k8s/train.yaml's 2 sequences of 4096 per GPU; with a global batch of 64 on 16 GPUs each GPU runs 2
    micro-batches of them per optimizer step, and on 32 GPUs one."""
    base = ["training.batch_size=2", "training.seq_len=4096"]
    accumulated = load_train_config(None, [*base, "training.global_batch_size=64"])
    assert Schedule.from_config(load_train_config(None, base), 16).tokens_per_gpu == 8192
    assert Schedule.from_config(accumulated, 16).tokens_per_gpu == 2 * 8192
    assert Schedule.from_config(accumulated, 32).tokens_per_gpu == 8192
    step = capacity_of(EIGHT_B, P5_48XLARGE, 2, FsxSpec(1200, 1000), Schedule.from_config(accumulated, 16)).step_s
    assert step == pytest.approx(2 * STEP_8B)


@pytest.mark.parametrize("gib, tier, gbs, usd", [
    (1200, 250, 1200 / 1024 * 250e6 / 1e9, 252.0),  # 0.293 GB/s: the issue's "0.29 GB/s"
    (1200, 1000, 1200 / 1024 * 1000e6 / 1e9, 720.0),
    (4800, 125, 4.6875 * 125e6 / 1e9, 696.0),
])
def test_fsx_throughput_is_storage_times_tier_and_price_is_per_gb_month(gib, tier, gbs, usd) -> None:
    fsx = FsxSpec(gib, tier)
    assert fsx.throughput_gbs == pytest.approx(gbs) and fsx.usd_per_month == pytest.approx(usd)


@pytest.mark.parametrize("gib, tier, allowed", [(1000, 250, "1200 or a multiple of 2400"),
                                                (2400, 200, "one of [125, 250, 500, 1000]")])
def test_fsx_refuses_what_persistent_2_does_not_offer(gib, tier, allowed) -> None:
    with pytest.raises(ValueError, match=re.escape(allowed)):
        FsxSpec(gib, tier)


def test_the_issues_default_fsx_cannot_keep_the_8b_jobs_promises() -> None:
    c = capacity_of(EIGHT_B, P5_48XLARGE, 2, FsxSpec(1200, 250), dataclasses.replace(JOB, drain_timeout_s=300))
    save = 96_363_134_976 / (1200 / 1024 * 250e6)
    assert c.save_s == pytest.approx(save) and c.save_s == pytest.approx(329, abs=0.5)
    assert c.min_interval_steps == math.ceil(ASYNC_SAVE_HEADROOM * save / STEP_8B) == 463
    assert not c.save_fits_interval and not c.drain_commits
    interval, drain = c.problems()
    assert "takes 329 s, and with 1.5x headroom for a slower save needs 493 s, longer than checkpoint.interval=200 " \
           "steps (~213 s" in interval
    assert "Raise checkpoint.interval to at least 463, or FSx throughput (fsxThroughputPerTib, fsxStorageGib) to " \
           "0.68 GB/s" in interval
    assert "up to 329 s" in drain and "fault_tolerance.drain_timeout_s=300" in drain
    assert "Raise drain_timeout_s to at least 329 (1316 to also save the step reached)" in drain
    assert "REFUSED" in format_capacity(c)


def test_the_chosen_fsx_keeps_them() -> None:
    c = capacity_of(EIGHT_B, P5_48XLARGE, 2, FsxSpec(1200, 1000), JOB)
    assert c.save_s == pytest.approx(82.2, abs=0.1)
    assert c.min_interval_steps == math.ceil(ASYNC_SAVE_HEADROOM * c.save_s / STEP_8B) == 116
    assert c.save_fits_interval and c.drain_commits and c.problems() == []
    assert c.drain_steps_lost == 0
    assert c.footprint_bytes == 4 * EIGHT_B.state_bytes and c.footprint_fits  # 359 GiB of 1200


@pytest.mark.parametrize("interval, fits", [(100, False), (115, False), (116, True)])
def test_an_async_save_needs_headroom_not_only_its_duration(interval: int, fits: bool) -> None:
    """An 82 s save fits within 100 steps (~107 s) only if it never runs slower than projected: the interval must
    cover ASYNC_SAVE_HEADROOM times it (116 steps), the same figure the planner recommends at least."""
    c = capacity_of(EIGHT_B, P5_48XLARGE, 2, FsxSpec(1200, 1000), dataclasses.replace(JOB, interval=interval))
    assert c.save_s < c.interval_s
    assert c.save_fits_interval is fits and (c.problems() == []) is fits
    assert c.fsx_steps_lost == interval + 78  # the commit lag is the save's duration, without the headroom


def test_peer_copy_send_and_the_interval_they_allow() -> None:
    c = capacity_of(EIGHT_B, P5_48XLARGE, 2, FsxSpec(1200, 1000), JOB)
    assert c.peer_copy_s == pytest.approx(6.02e9 / 25e9, rel=1e-3)  # one GPU's shard at 25 GB/s
    # 8 gloo flows of 10 Gbps (cluster placement group), at half their line rate: 5 GB/s per node
    assert P5_48XLARGE.tcp_send_gbs == pytest.approx(5.0)
    # the thread checksums the copy (CRC-32, one core, the bench's rate), then sends the node's 48 GB
    assert c.peer_checksum_s == pytest.approx(6.02e9 / (CRC32_GBS * 1e9), rel=1e-3)
    assert c.peer_send_s == pytest.approx(c.peer_checksum_s + 48.18e9 / 5e9, rel=1e-3)
    # the send, not the copy, sets it: 16.3 steps, with peer state's 1.5x headroom a deadline of 25
    assert c.peer_interval_steps == c.peer_deadline_steps == math.ceil(1.5 * c.peer_send_s / STEP_8B) == 25
    assert c.peer_steps_lost == 25 + 25 - 1  # a copy every 25 steps, each acknowledged within the next 25
    # a configured interval is the promise: a copy every 3 steps, each with 2 to reach the partner, 4 lost at most
    promised = capacity_of(EIGHT_B, P5_48XLARGE, 2, FsxSpec(1200, 1000),
                           Schedule(200, 3, "async", 300, True, peer_interval=4))
    assert (promised.peer_interval_steps, promised.peer_deadline_steps, promised.peer_steps_lost) == (3, 2, 4)
    assert c.restore_peer_s == pytest.approx(c.peer_send_s)  # the same bytes received, then checked
    two_replicas = capacity_of(EIGHT_B, P5_48XLARGE, 4, FsxSpec(1200, 1000),
                               Schedule(200, 3, "async", 360, True, peer_replicas=2))
    assert two_replicas.peer_send_s == pytest.approx(3.01e9 / (CRC32_GBS * 1e9) + 2 * 24.09e9 / 5e9, rel=1e-3)


def test_steps_lost_per_mechanism() -> None:
    c = capacity_of(EIGHT_B, P5_48XLARGE, 2, FsxSpec(1200, 1000), JOB)
    assert c.fsx_steps_lost == 200 + 78  # the newest checkpoint commits a save's duration after its step
    short = capacity_of(EIGHT_B, P5_48XLARGE, 2, FsxSpec(1200, 1000), Schedule(200, 3, "async", 200, True))
    assert short.drain_commits and short.drain_steps_lost == 278  # commits the in-flight save, not the step reached
    none = capacity_of(EIGHT_B, P5_48XLARGE, 2, FsxSpec(1200, 1000), Schedule(200, 3, "async", 60, True))
    assert not none.drain_commits and none.drain_steps_lost == 278 + 200


def test_keep_beyond_the_file_system_is_refused_with_the_size_that_fits() -> None:
    c = capacity_of(EIGHT_B, P5_48XLARGE, 2, FsxSpec(1200, 1000), Schedule(200, 20, "async", 300, True))
    (problem,) = c.problems()
    assert "checkpoint.keep=20 checkpoints and one in flight take 1885 GiB, more than FSx's 1200 GiB" in problem
    assert "raise fsxStorageGib to 2400" in problem
    assert smallest_storage_gib(1200 * 2**30) == 1200 and smallest_storage_gib(1201 * 2**30) == 2400
    assert smallest_storage_gib(4801 * 2**30) == 7200


def test_a_heal_must_end_within_torchfts_step_timeout_that_bounds_it() -> None:
    # a replica group of one p5 node holds the whole 8b state: each of its 8 ranks fetches its shard over TCP
    groups = dataclasses.replace(JOB, peer_state=False, replica_groups=2, step_timeout_s=10)
    one_node = capacity_of(EIGHT_B, P5_48XLARGE, 1, FsxSpec(1200, 1000), groups)
    assert one_node.heal_s == pytest.approx(EIGHT_B.state_bytes / (P5_48XLARGE.tcp_send_gbs * 1e9))
    assert one_node.heal_s == pytest.approx(19.3, abs=0.1)  # 96.4 GB at 5.0 GB/s
    (problem,) = one_node.problems()
    assert "heals 96.4 GB per node from a live group" in problem and "19.3 s" in problem
    assert "parallel.step_timeout_s=10" in problem and "Raise parallel.step_timeout_s to at least 29" in problem
    assert "heal" in format_capacity(one_node) and "DOES NOT FIT" in format_capacity(one_node)
    # 16 nodes per group: 6 GB per node, 1.2 s; and without replica groups there is no heal to bound
    assert capacity_of(EIGHT_B, P5_48XLARGE, 16, FsxSpec(1200, 1000), groups).problems() == []
    plain = dataclasses.replace(groups, replica_groups=1)
    assert capacity_of(EIGHT_B, P5_48XLARGE, 1, FsxSpec(1200, 1000), plain).heal_fits
    assert "heal" not in format_capacity(capacity_of(EIGHT_B, P5_48XLARGE, 1, FsxSpec(1200, 1000), plain))


def test_a_sync_save_blocks_but_never_overlaps_the_next() -> None:
    c = capacity_of(EIGHT_B, P5_48XLARGE, 2, FsxSpec(1200, 250), Schedule(200, 3, "sync", 600, False))
    assert c.blocking_s == c.save_s and c.save_fits_interval and c.problems() == []


def test_hsdp_memory_step_cost_and_recovery_by_hand() -> None:
    c = capacity_of(EIGHT_B, P5_48XLARGE, 32, FsxSpec(1200, 1000), JOB)
    h = HsdpCase(c)
    assert h.fsdp_gpu_bytes == pytest.approx(16 * 8_030_261_248 / 256)  # weights, grads, two moments, fp32
    assert h.hsdp_gpu_bytes == pytest.approx(2 * h.fsdp_gpu_bytes)
    # each GPU all-reduces its fp32 gradient shard (the model over a replica group's 128 GPUs) with its one
    # replica: a ring of two sends 2(R-1)/R = 1 shard, at 400 GB/s / 8 GPUs x 0.75 = 37.5 GB/s
    shard = 4 * 8_030_261_248 / 128
    assert h.step_cost_s == pytest.approx(shard / 37.5e9) and h.step_cost_s == pytest.approx(6.7e-3, abs=1e-4)
    node_state = 16 * 8_030_261_248 / 16  # the replica group's node holds 1/16 of the model
    assert h.stream_s == pytest.approx(node_state / 300e9)
    assert h.recovery_s == pytest.approx(30 + 17 + h.stream_s)  # detection, restart on p5 (k8s_delays), stream
    assert h.lost_gpu_s == pytest.approx(h.recovery_s * 128)  # only the failed replica group waits


@pytest.mark.parametrize("grace_s, keeps_the_step", [(360, True), (300, False)])
def test_the_drain_keeps_the_step_reached_exactly_when_the_model_says_so(grace_s, keeps_the_step) -> None:
    """The model's grace is what the drain's own planner asks in the worst case: the in-flight save had just
    started when SIGTERM came, so what is left of it and a save of the step reached, each as long as a save."""
    c = capacity_of(EIGHT_B, P5_48XLARGE, 2, FsxSpec(1200, 1000),
                    Schedule(interval=200, keep=3, mode="async", drain_timeout_s=grace_s, peer_state=False))
    cost = checkpoint_cost(200, enabled=True, saved_step=None, in_flight=(100, 0.0), last_save_s=c.save_s)
    views = [DrainView(grace_s, cost, IMPOSSIBLE, signalled=rank < 8) for rank in range(16)]
    plan = plan_drain(views, ranks_per_node=8, replicas=1)
    assert (plan.path == "checkpoint") is keeps_the_step
    assert (c.drain_steps_lost == 0) is keeps_the_step


@pytest.mark.parametrize("preset, device_gb, reduce", [
    ("8b", 80, "micro_batch"),  # 4 B x 8.03 B = 32.1 GB of unsharded gradients: more than 8 GB of an H100's 80 GB
    ("1b", 80, "step"),         # 4 B x 1.50 B = 6.0 GB: within a tenth
    ("1b", 40, "micro_batch"),  # an A100 40 GB: 6.0 GB is more than its 4 GB tenth
    ("tiny", 16, "step"),       # 0.5 MB on a CPU host
])
def test_gradient_accumulation_reduces_once_per_step_only_while_unsharded_gradients_stay_small(preset, device_gb,
                                                                                               reduce):
    """training.gradient_reduce=auto: the whole model's fp32 gradients, held unsharded until the last micro-batch,
    against a tenth of the device's memory; a setting other than auto is kept."""
    parameters = ModelFootprint.from_preset(preset, 64).parameters
    assert gradient_reduce("auto", parameters, device_gb * 1e9) == reduce
    assert {gradient_reduce(s, parameters, device_gb * 1e9) for s in ("step", "micro_batch")} == {"step", "micro_batch"}
