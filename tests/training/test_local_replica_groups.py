"""`python -m training.local --replica-groups R`: each group a Job of its own under one torchft Lighthouse.
Two composed runs: a lost node in one group, whose hot spare takes its place, the Lighthouse killed, a hung rank
in the other group; then a node cut off from the network (--netns), which sends no TCP reset, as on EKS, and a
drained node. What a user is promised: the other group trains on through each fault, the failed group heals
from its live state, a restarted Lighthouse restarts no group, no completed step is lost, every sample is
trained once, and both groups end with the same state, bit for bit."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from training.contract.events import read_events
from training.contract.exit_codes import CONFIG_ERROR
from training.local import cli as local
from training.contract.replica_groups import group_run_dir
from training.local.netns import unavailable_reason
from training.local.replica_groups import longest_stall
from training.local.shape import ClusterShape
from training.report.goodput import build_report
from training.train.checkpoint.layout import committed_checkpoints
from training.train.final_state import bitwise_mismatch, load_final_state
from training_helpers import completed, exit_code, once_per_session, run_forked, run_local, samples_by_step

STEPS, GLOBAL_BATCH = 350, 16  # 16: a row of 4 sequences per rank of a group, one row per group
# the Lighthouse's loss and the hang land once the lost node's group is back: its restart takes 70-90 of these
# steps here (a Lighthouse lost while the group heals stalls the other group until a reused quorum id fails)
NODE_LOSS, LIGHTHOUSE_LOSS, HANG = 40, 160, 240
DRAIN, SAVE_INTERVAL = 120, 50
STEP_TIMEOUT_S = 3  # parallel.step_timeout_s: what a restarted Lighthouse's reused quorum id can cost a step
# heartbeat_timeout_s (1 s) plus re-forming the quorum's process group after a group's fault; a restarted
# Lighthouse: the poll (1 s), then a step that may wait out STEP_TIMEOUT_S; a hung rank: its step timeout,
# learned from its own work (the waits for the other group are outside it), plus up to the rank monitor's
# check interval (fault_tolerance.rank_check_interval_s), then the same; on 2 busy cores
STALL_BOUND_S = 6.0


TRAINING = ("--steps", str(STEPS), f"training.global_batch_size={GLOBAL_BATCH}", "checkpoint.mode=off",
            "checkpoint.save_final=true", "logging.sample_log=true", f"parallel.step_timeout_s={STEP_TIMEOUT_S}")
GROUPS = ClusterShape(nodes=4, nproc_per_node=1, replica_groups=2)  # two groups of two nodes of one rank


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    """The same global batch on one FSDP2 group of 2 ranks, no fault: forked from the test process."""
    return once_per_session(tmp_path_factory, "local-replica-groups-reference",
                            lambda run_dir: completed(run_forked(run_dir, 2, *TRAINING)).run_dir)


def _losses(run_dir: Path) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in read_events(run_dir) if e["event"] == "step"}


def _died_in(events: list[dict]) -> set[int]:
    """The steps a group was training when an attempt of it ended: the one after its attempt's last step."""
    died, last = set(), None
    for e in events:
        if e["event"] == "resume" and last is not None:
            died.add(last + 1)
        elif e["event"] == "step":
            last = e["step"]
    return died


def _assert_the_uninterrupted_run(groups: list[Path], events: list[list[dict]], uninterrupted: Path,
                                  tmp_path: Path) -> None:
    """What a user is promised whatever the faults: the uninterrupted run's losses, every sample once, both
    groups' final states bit for bit the same."""
    # every step's loss is the uninterrupted run's, whichever groups were live (float tolerance: the sum splits)
    reference = _losses(uninterrupted)
    for directory in groups:
        assert _losses(directory) == pytest.approx({s: reference[s] for s in _losses(directory)}, rel=1e-5, abs=1e-6)

    # no sample twice; a step misses logged samples only where a group died after its rows were summed: the
    # other group's commit holds them (its loss above is the whole batch's)
    by_step = samples_by_step(groups[0])
    for step, indices in samples_by_step(groups[1]).items():
        by_step.setdefault(step, []).extend(indices)
    died = _died_in(events[0]) | _died_in(events[1])
    for step in range(1, STEPS + 1):
        logged, expected = sorted(by_step.get(step, [])), list(range((step - 1) * GLOBAL_BATCH, step * GLOBAL_BATCH))
        assert len(set(logged)) == len(logged) and set(logged) <= set(expected), step
        assert logged == expected or step in died, step

    # both groups end bit for bit the same
    mismatch = bitwise_mismatch(load_final_state(groups[0], tmp_path), load_final_state(groups[1], tmp_path))
    assert mismatch is None, mismatch


@pytest.mark.slow
@pytest.mark.alone  # its stall bound
def test_a_group_trains_through_the_other_groups_faults_and_both_end_the_same(tmp_path, uninterrupted):
    # a hot spare in each group; a lost node's replacement comes later, as on EKS, and stands by
    run = completed(run_local(
        tmp_path / "run", *replace(GROUPS, spares=1, replacement_delay_s=local.DEMO_REPLACEMENT_DELAY_S).argv(),
        *TRAINING,
        "--faults", f"node-loss@{NODE_LOSS}:node=1:group=1,lighthouse-loss@{LIGHTHOUSE_LOSS}:group=0,"
                    f"hang@{HANG}:rank=0:group=0", timeout=400))
    groups = [group_run_dir(run.run_dir, g) for g in (0, 1)]
    events = [read_events(g) for g in groups]

    # each fault fired once, in its own group; that group healed from the other's live state, not from step 0
    fired = [[e["kind"] for e in group if e["event"] == "fault_injected"] for group in events]
    assert fired == [["lighthouse-loss", "hang"], ["node-loss"]], fired
    assert "the Lighthouse exited with code -9; starting it again" in run.output
    # group 1's spare (its node 2) took the lost node's place; group 0's stood by through its in-job restart
    assert "Assigned active rank" in (groups[1] / "logs" / "node2.log").read_text()
    assert "Assigned active rank" not in (groups[0] / "logs" / "node2.log").read_text()
    # the restarted Lighthouse restarted no group: each resumed at its start and after its own fault only, that
    # time from the other group's live state, reading no checkpoint
    assert [[e["source_kind"] for e in group if e["event"] == "resume"][1:] for group in events] == [["live"]] * 2
    for group in events:
        [fault_t] = [e["t"] for e in group if e["event"] == "fault_injected" and e["kind"] != "lighthouse-loss"]
        heals = [e for e in group if e["event"] == "quorum" and e.get("healed_from_step") is not None
                 and e["t"] > fault_t]
        assert heals and heals[0]["live_groups"] == 2, "no heal after the fault: the other group's came first?"

    # the other group never stopped longer than the bound; the report loses no completed step to either fault
    for directory, group in zip(groups, events):
        stall, before = longest_stall(directory)
        assert stall < STALL_BOUND_S, f"{directory.name} stalled {stall:.2f} s before step {before}"
        assert all(f.steps_lost == 0 for f in build_report(group).faults), run.output[-3000:]
    assert "group 0: " in run.output and "group 1: " in run.output  # the controller's stall summary

    _assert_the_uninterrupted_run(groups, events, uninterrupted, tmp_path)


# the node's silence (parallel.node_pulse_timeout_s, 5 s), the Lighthouse dropping its group (heartbeat_timeout_s, 1 s), the quorum
# re-formed, on 2 busy cores; with NVRx's step timeout alone (no pulse) it was 19 s here
PARTITION_STALL_BOUND_S = 10.0


@pytest.mark.slow
@pytest.mark.alone  # its stall bound
@pytest.mark.skipif(unavailable_reason() is not None, reason=f"network namespaces unavailable: {unavailable_reason()}")
def test_a_cut_off_node_and_a_drained_one_take_only_their_group_out_and_the_other_trains_on(tmp_path, uninterrupted):
    # group 1's second node cut off: its rank 0 (the group's Manager) heartbeats on, so the nodes' pulse or the
    # rank's own step timeout must take the group out; then group 0's first node drained. Checkpoints on: one
    # group writes each, and a drained group that comes back after the other finished resumes from it
    run = completed(run_local(tmp_path / "run", *replace(GROUPS, netns=True).argv(), *TRAINING,
                              "checkpoint.mode=async", f"checkpoint.interval={SAVE_INTERVAL}", "--faults",
                              f"partition@{NODE_LOSS}:node=1:group=1:duration=10,drain@{DRAIN}:node=0:group=0",
                              timeout=400))
    groups = [group_run_dir(run.run_dir, g) for g in (0, 1)]
    events = [read_events(g) for g in groups]
    assert [[e["kind"] for e in group if e["event"] == "fault_injected"] for group in events] == [["drain"],
                                                                                                  ["partition"]]
    # the cut-off node's group left: its rank 0 stopped by the pulse, or first by its step timeout (stuck in a
    # collective with the cut-off node, in its own work); either ends the Manager's heartbeats
    log = (groups[1] / "logs" / "node0.log").read_text()
    assert "has not beaten for" in log or "failed (exitcode: -9) local_rank: 0" in log, log[-3000:]
    stall, before = longest_stall(groups[0])
    assert stall < PARTITION_STALL_BOUND_S, f"group 0 stalled {stall:.2f} s before step {before}"
    [cut_off] = [e["t"] for e in events[1] if e["event"] == "fault_injected"]
    heals = [e for e in events[1] if e["event"] == "quorum" and e.get("healed_from_step") is not None
             and e["t"] > cut_off]
    assert heals and heals[0]["live_groups"] == 2, "group 1 never healed back into the quorum"
    back = [e["source_kind"] for e in events[1] if e["event"] == "resume"][1:]
    assert back and set(back) == {"live"}, back  # while group 0 trained: its live state, no checkpoint read
    assert all(f.steps_lost == 0 for group in events for f in build_report(group).faults), run.output[-3000:]
    written = sorted(step for g in groups for step, _ in committed_checkpoints(g / "checkpoints"))
    assert written == sorted(set(written)) and written[-1] == STEPS, written  # each step once, by one group
    _assert_the_uninterrupted_run(groups, events, uninterrupted, tmp_path)


def test_replica_groups_that_do_not_divide_the_nodes_are_refused_in_one_line(tmp_path, capsys):
    argv = ["--run-dir", str(tmp_path / "run"), "--nodes", "4", "--replica-groups", "3"]
    assert exit_code(local.main, argv) == CONFIG_ERROR
    [line] = capsys.readouterr().err.strip().splitlines()
    assert "--replica-groups=3 does not divide --nodes=4" in line and "allowed: [1, 2, 4]" in line, line
    assert not (tmp_path / "run" / "logs").exists()
