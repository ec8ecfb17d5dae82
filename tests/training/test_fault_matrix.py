"""The fault matrix (training.train.faults) in the local cluster: one run per fault kind, each checked
for recovery (run completed, the fault fired once, resumed where promised, the goodput report gives
a finite recovery time) and for exact resume (final model and optimizer bitwise equal to an
uninterrupted run); a persistent fault ends the job after its restart budget. First, the spec
parsing and the injector's bookkeeping, in-process."""
from __future__ import annotations

import json
import math
import re
import time
from collections import Counter
from dataclasses import dataclass, replace

import pytest

from training.contract.config import load_train_config
from training.contract.events import EventLog, read_events
from training.contract.exit_codes import NO_PROGRESS
from training.contract.faults import ENV_VAR, KINDS, FaultSpecError, parse_fault, parse_faults, with_env_faults
from training.local.shape import ClusterShape
from training.report.goodput import build_report
from training.train.checkpoint.layout import committed_checkpoints
from training.train.faults import FaultInjected, FaultInjector
from training_helpers import (COLLECTIVE_TIMEOUT_S, COMMON, GLOBAL_BATCH, ONE_NODE, RANKS, STEPS, TWO_NODES,
                              assert_bitwise_equal, completed, events_named, load_final_state, once_per_session,
                              run_local)

# ---- specs and the injector, in-process ---------------------------------------------------------


@pytest.mark.parametrize("text, key", [
    ("hang@12:rank=1", "hang@12_rank=1"),
    ("node-loss@5:node=0", "node-loss@5_node=0"),
    ("partition@5:node=1:duration=20", "partition@5_duration=20_node=1"),
    ("partition@5:rank=3", "partition@5_rank=3"),
    ("ckpt-crash@10:rank=1", "ckpt-crash@10_rank=1"),
    ("corrupt-ckpt@13", "corrupt-ckpt@13_rank=0"),
    ("disk-full@8:count=2", "disk-full@8_count=2_rank=0"),
    ("exception@3:rank=1:persistent", "exception@3_persistent_rank=1"),
])
def test_new_kinds_parse(text, key):
    assert parse_fault(text).key == key


@pytest.mark.parametrize("text, problem", [
    ("node-loss@5", "node-loss needs node=N"),
    ("node-loss@5:rank=1:node=1", "node-loss needs node=N (the node index) or rank=R"),
    ("drain@5:count=2", "unknown option 'count' for drain"),
    ("partition@5", "partition needs node=N"),
    ("partition@5:node=1:duration=0", "duration='0' is not a whole number, at least 1"),
    ("drain@5:node=1:duration=3", "unknown option 'duration' for drain"),
    ("disk-full@5:count=0", "count='0' is not a whole number, at least 1"),
    ("hang@5:persistent=yes", "persistent is a flag and takes no value"),
    ("corrupt-ckpt@5:persistent", "unknown option 'persistent' for corrupt-ckpt"),
    ("hang@5:rank=1:rank=2", "option 'rank' given twice"),
])
def test_bad_new_specs_are_rejected_clearly(text, problem):
    with pytest.raises(FaultSpecError) as err:
        parse_fault(text)
    assert repr(text) in str(err.value) and problem in str(err.value)


def test_fault_node_must_exist():
    with pytest.raises(FaultSpecError, match=r"node 2 does not exist \(2 node\(s\)\)"):
        parse_faults(["node-loss@3:node=2"], world_size=2, nodes=2)


def test_a_fault_names_a_replica_group_that_exists_and_fires_only_there(tmp_path, monkeypatch):
    assert parse_fault("node-loss@5:node=1:group=1").key == "node-loss@5_group=1_node=1"
    with pytest.raises(FaultSpecError, match=r"replica group 2 does not exist \(parallel.replica_groups=2: group=0 to 1\)"):
        parse_faults(["exception@3:group=2"], groups=2)
    monkeypatch.setenv("TRAINING_REPLICA_GROUP", "1")
    _injector(tmp_path, "exception@3:group=0").maybe_fire(3)  # group 0's rank 0, not this group's
    with pytest.raises(FaultInjected):
        _injector(tmp_path, "exception@3:group=1").maybe_fire(3)


def test_env_faults_join_the_config_once(monkeypatch):
    cfg = load_train_config(None, ["faults=[exception@3]"])
    monkeypatch.setenv(ENV_VAR, " hang@4:rank=1, exception@3 ,")
    assert with_env_faults(cfg).faults == ("exception@3", "hang@4:rank=1")
    assert with_env_faults(with_env_faults(cfg)).faults == ("exception@3", "hang@4:rank=1")


def _injector(tmp_path, *specs, rank=0):
    return FaultInjector(parse_faults(list(specs)), tmp_path, rank, EventLog(tmp_path, f"rank{rank}"),
                         tmp_path / "checkpoints")


def _write():
    return "written"


def test_disk_full_fails_count_saves_once_per_run(tmp_path):
    injector = _injector(tmp_path, "disk-full@8:count=2")
    assert injector.around_write(5, _write) == "written"  # before STEP
    for step in (10, 15):
        with pytest.raises(OSError, match="No space left on device"):
            injector.around_write(step, _write)
    assert injector.around_write(20, _write) == "written"
    assert _injector(tmp_path, "disk-full@8:count=2").around_write(25, _write) == "written"  # fired: not again
    assert [e["step"] for e in read_events(tmp_path) if e["event"] == "fault_injected"] == [10]


def test_persistent_fault_fires_on_every_attempt(tmp_path):
    for attempt in range(2):  # a new injector per attempt, as after a restart
        injector = _injector(tmp_path, "exception@3:rank=1:persistent", "exception@4:rank=1", rank=1)
        with pytest.raises(FaultInjected):
            injector.maybe_fire(3)
        if attempt == 0:
            with pytest.raises(FaultInjected):
                injector.maybe_fire(4)
        else:
            injector.maybe_fire(4)  # fired on the first attempt: not again
    assert [e["spec"] for e in read_events(tmp_path) if e["event"] == "fault_injected"] == \
        ["exception@3:rank=1:persistent", "exception@4:rank=1", "exception@3:rank=1:persistent"]


def test_a_fault_whose_step_the_rank_never_trains_fires_at_the_next_step_it_does(tmp_path):
    # a replica group that healed from step 0 to 9 past exception@6, or an operator's fault for a step gone by
    injector = _injector(tmp_path, "exception@6:rank=1", "exception@6:rank=1:persistent", rank=1)
    injector.maybe_fire(5)
    with pytest.raises(FaultInjected):
        injector.maybe_fire(10)
    injector.maybe_fire(11)  # once per run; the persistent one only at its step
    assert [(e["spec"], e["step"]) for e in read_events(tmp_path) if e["event"] == "fault_injected"] == \
        [("exception@6:rank=1", 10)]


# ---- the matrix in the local cluster -------------------------------------------------------------

# with a hot spare: above its takeover when the survivor only learns of the lost peer from NVRx's calculated
# step timeout (17 s on a loaded 2-core box), not from gloo at once; the run's end waits it out
REPLACEMENT_DELAY_S = 30
PEER_STATE = ("peer_state.enabled=true", "peer_state.interval=1")
SAMPLE_LOG = "logging.sample_log=true"  # each rank's sample indices per step: the exactly-once data check


@dataclass(frozen=True)
class Case:
    shape: ClusterShape
    mode: str  # checkpoint.mode
    spec: str
    resumed_from: int | None  # the step the restart resumes from; None: no restart
    overrides: tuple[str, ...] = ()
    via_env: bool = False  # inject through TRAINING_FAULTS instead of --faults

    def args(self) -> tuple[str, ...]:
        faults = () if self.via_env else ("--faults", self.spec)
        return (*self.shape.argv(), *COMMON, f"checkpoint.mode={self.mode}", *self.overrides, *faults)


# A hang and a corrupt checkpoint: in the mixed runs (MIXED_CASES below), each checked on its own there.
CASES = {
    # sync saves: step 10 is committed before the fault for sure (an async one may still be in flight). The
    # spare (node 2) takes node 1's place; node 1's replacement starts only after the run's end. (A lost node
    # without a spare, trained on by its replacement: the "bare" cases of LOSS_CASES below.)
    "node-loss-spare": Case(replace(TWO_NODES, spares=1, replacement_delay_s=REPLACEMENT_DELAY_S), "sync",
                            "node-loss@12:node=1", 10),
    # rank 1 dies writing the save of step 10: back to step 5
    "ckpt-crash": Case(ONE_NODE, "async", "ckpt-crash@10:rank=1", 5, (SAMPLE_LOG,)),
    # the saves of steps 10 and 15 fail; training goes on, step 20 commits
    "disk-full": Case(ONE_NODE, "async", "disk-full@8:count=2", None, via_env=True),
}


# Rank 0's node lost, then another rank's, in every restart mode; with neither hot spare nor peer state (the
# lost node's replacement, the FSx checkpoint) and with both (the spare takes its place, the partner's copy).
# With restart=both the in-process Wrapper's stores once lived in rank 0's process: losing its node left the
# survivors' Wrapper without them, and training stalled for good. They live in the rendezvous store now, off
# the nodes (training/train/coordination.py), and a lost rank 0 is a lost node like any other.
LOSSES = "node-loss@8:rank=0,node-loss@16:rank=1"
SHAPES = {"bare": (TWO_NODES, ()), "spare-peer": (replace(TWO_NODES, spares=1), PEER_STATE)}  # with overrides
LOSS_CASES = {f"{name}-{mode}": Case(shape, "sync", LOSSES, None,
                                      (*overrides, f"fault_tolerance.restart={mode}"))
              for name, (shape, overrides) in SHAPES.items() for mode in ("injob", "both")}


@pytest.fixture(scope="module")
def fault_run(tmp_path_factory):
    """fault_run(name): the run of CASES, LOSS_CASES or MIXED_CASES[name], run once per session."""
    def get(name):
        case = {**CASES, **LOSS_CASES, **MIXED_CASES}[name]
        env = {ENV_VAR: case.spec} if case.via_env else None
        return once_per_session(tmp_path_factory, f"fault-matrix-{name}",
                                lambda run_dir: completed(run_local(run_dir, *case.args(), env=env, timeout=420)))
    return get


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_recovers_and_resumes_exactly(name, fault_run, reference, scratch):
    case, run = CASES[name], fault_run(name)
    assert [e["spec"] for e in events_named(run.run_dir, "fault_injected")] == [case.spec]  # once
    assert [e["status"] for e in events_named(run.run_dir, "run_end")] == ["completed"]
    resumes = [e["step"] for e in events_named(run.run_dir, "resume")]
    assert resumes == ([0] if case.resumed_from is None else [0, case.resumed_from])
    [fault] = build_report(read_events(run.run_dir)).faults
    assert fault.kind == case.spec.split("@")[0]
    assert fault.recovery_s is not None and math.isfinite(fault.recovery_s) and fault.recovery_s > 0
    if case.resumed_from is not None:
        assert fault.resumed_from == case.resumed_from
        assert fault.detection_s is not None and 0 <= fault.detection_s < fault.recovery_s
    assert_bitwise_equal(load_final_state(run.run_dir, scratch), load_final_state(reference.run_dir, scratch))


def _detections(run, by):
    return [e for e in events_named(run.run_dir, "fault_detected") if e["by"].startswith(by)]


@pytest.mark.slow
def test_hang_is_detected_by_nvrx_before_the_collective_timeout(fault_run):
    run = fault_run("mixed-injob")
    [injected] = [e for e in events_named(run.run_dir, "fault_injected") if e["kind"] == "hang"]
    after = [e for e in events_named(run.run_dir, "fault_detected") if e["t"] > injected["t"]]
    first = min(after, key=lambda e: e["t"])
    assert first["by"].startswith("nvrx rank monitor") and "Section 'step' has been open" in first["detail"]
    assert 0 < first["t"] - injected["t"] < COLLECTIVE_TIMEOUT_S  # not gloo's timeout


@pytest.mark.slow
def test_node_loss_replaces_that_node(fault_run):
    run = fault_run("node-loss-spare")  # replaced after the spare took its place: the bare cases below train on it
    assert [(e["node"], e["attempt"]) for e in events_named(run.run_dir, "node_replaced")] == [(1, 1)]
    assert [e["restart_kind"] for e in events_named(run.run_dir, "restart") if e["source"] == "controller"] == ["node"]
    assert [e["detail"] for e in _detections(run, "controller")] == [
        "node 1 lost (its launcher was killed by SIGKILL; on EKS the taint manager or PodGC removes its pod with "
        "DisruptionTarget)"]


@pytest.mark.slow
def test_a_hot_spare_takes_the_lost_nodes_place_without_waiting_for_its_replacement(fault_run):
    run = fault_run("node-loss-spare")
    [fault] = build_report(read_events(run.run_dir)).faults
    assert fault.recovery_s < REPLACEMENT_DELAY_S
    spare_log = (run.run_dir / "logs" / "node2.log").read_text()
    rounds = [int(r) for r in re.findall(r"Assigned active rank \d+ \(round=(\d+)\)", spare_log)]
    assert rounds and min(rounds) >= 1  # it stood by while the first round trained, then took node 1's place
    finished = max(e["t"] for e in events_named(run.run_dir, "run_end"))
    [replaced] = events_named(run.run_dir, "node_replaced")
    assert finished < replaced["t"] + REPLACEMENT_DELAY_S  # the run ended before node 1's replacement was due
    # ... and the Job with it (job_rules.job_succeeded): the replacement never started
    [job_start] = events_named(run.run_dir, "job_start")
    assert job_start["t"] + float(re.search(r"finished in ([\d.]+) s", run.output)[1]) < replaced["t"] + REPLACEMENT_DELAY_S


@pytest.mark.slow
def test_a_lost_node_resumes_from_peer_state_without_losing_a_completed_step(fault_run):
    """Peer state: each lost node's state comes from its partner's memory, a spare takes its place. A node is
    lost halfway through steps 8 and 16: every rank resumes at the newest completed step, 7 and 15 (or 8 and 16,
    when the step was quicker than the last), not at the checkpoints of steps 5 and 15. The run is
    test_losing_rank_0s_node_then_another_resumes_exactly's, which also finds its final state exact."""
    run = fault_run("spare-peer-injob")
    resumes = [(e["step"], e["source_kind"]) for e in events_named(run.run_dir, "resume")]
    assert resumes[0] == (0, "none") and [kind for _, kind in resumes[1:]] == ["peer", "peer"]
    assert resumes[1][0] in (7, 8) and resumes[2][0] in (15, 16)
    faults = build_report(read_events(run.run_dir)).faults
    assert [(f.steps_lost, f.recovery_s is not None) for f in faults] == [(0, True), (0, True)]
    [settled] = events_named(run.run_dir, "peer_state")[:1]
    assert settled["interval"] == 1 and settled["bytes_per_rank"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LOSS_CASES))
def test_losing_rank_0s_node_then_another_resumes_exactly(name, fault_run, reference, scratch):
    """With a spare, the spare holds the copies of the node it replaced, so the replacements (back at once, no
    delay) must not push it out: newer pods rank after older ones (test_launch checks the ranking)."""
    run = fault_run(name)
    assert [e["spec"] for e in events_named(run.run_dir, "fault_injected")] == LOSSES.split(",")
    [first, second] = build_report(read_events(run.run_dir)).faults
    assert (first.kind, first.rank, second.kind, second.rank) == ("node-loss", 0, "node-loss", 1)
    assert (first.restart_kind, second.restart_kind) == ("node", "node")
    assert all(f.detection_s is not None and 0 <= f.detection_s < f.recovery_s and math.isfinite(f.recovery_s)
               for f in (first, second))
    resumes = [(e["step"], e["source_kind"]) for e in events_named(run.run_dir, "resume")]
    if name.startswith("bare"):
        assert resumes == [(0, "none"), (5, "disk"), (15, "disk")]
    else:
        assert [kind for _, kind in resumes] == ["none", "peer", "peer"] and first.steps_lost == second.steps_lost == 0
    # the store outlived both: every launcher joined the one rendezvous (ft_launcher logs its config as it starts)
    launchers = "".join(p.read_text() for p in (run.run_dir / "logs").glob("node*.log"))
    assert len(set(re.findall(r"run_id\s*:\s*(\S+)", launchers))) == 1
    assert [e["status"] for e in events_named(run.run_dir, "run_end")] == ["completed"]
    assert_bitwise_equal(load_final_state(run.run_dir, scratch), load_final_state(reference.run_dir, scratch))


@pytest.mark.slow
def test_two_partners_lost_together_fall_back_to_the_checkpoint_and_say_so(tmp_path, reference, scratch):
    """Both nodes (each the other's partner) lost in the same step: no copy of their shards is left;
    the spares train from the FSx checkpoint."""
    run = completed(run_local(tmp_path / "run", *replace(TWO_NODES, spares=2).argv(), *COMMON, "checkpoint.mode=sync",
                              *PEER_STATE, "--faults", "node-loss@12:node=0,node-loss@12:node=1"))
    assert [(e["step"], e["source_kind"]) for e in events_named(run.run_dir, "resume")][-1] == (10, "disk")
    logs = "".join(p.read_text() for p in (run.run_dir / "logs").glob("node*.log"))
    assert "peer state: no step for which every shard has a copy" in logs
    assert_bitwise_equal(load_final_state(run.run_dir, scratch), load_final_state(reference.run_dir, scratch))


@pytest.mark.slow
def test_the_replacement_of_a_lost_node_becomes_the_new_spare(tmp_path, reference, scratch):
    """Two losses of the node that runs rank 1: the spare (node 2) takes node 1's place; node 1's
    replacement, started 3 s later (as Kubernetes starts it minutes later), stands by and takes node 2's."""
    specs = "node-loss@8:rank=1,node-loss@16:rank=1"
    run = completed(run_local(tmp_path / "run", *replace(TWO_NODES, spares=1, replacement_delay_s=3).argv(), *COMMON,
                              "checkpoint.mode=sync", "--faults", specs))
    assert [e["spec"] for e in events_named(run.run_dir, "fault_injected")] == specs.split(",")
    # Rank 1 starts on either training node (the rendezvous ranks the launchers in the order they join); the
    # spare (node 2) takes its place, so the second loss is the spare's and the standby replacement takes over.
    first, second = [e["node"] for e in events_named(run.run_dir, "node_replaced")]
    assert first in (0, 1) and second == 2
    assert [e["step"] for e in events_named(run.run_dir, "resume")] == [0, 5, 15]
    assert_bitwise_equal(load_final_state(run.run_dir, scratch), load_final_state(reference.run_dir, scratch))


@pytest.mark.slow
def test_crash_mid_save_never_commits_that_save(fault_run):
    run = fault_run("ckpt-crash")
    [injected] = events_named(run.run_dir, "fault_injected")
    assert (injected["rank"], injected["step"]) == (1, 10)
    assert (run.run_dir / "faults" / "fired" / parse_fault(CASES["ckpt-crash"].spec).key).is_file()  # once per run
    assert [(e["attempt"], e["restart_kind"]) for e in events_named(run.run_dir, "attempt_start")] == [
        (0, "fresh"), (1, "injob")]
    restarted = events_named(run.run_dir, "attempt_start")[1]["t"]
    committed_before = [e["step"] for e in events_named(run.run_dir, "ckpt_committed") if e["t"] < restarted]
    assert committed_before == [5]  # the save of step 10 started but never became visible


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ckpt-crash", "mixed-injob"])
def test_every_sample_is_consumed_exactly_once_across_restarts(name, fault_run):
    """ckpt-crash: an async save's crash, steps 6-10 done again; mixed-injob: an exception, a SIGKILL, a lost
    node, a hang and a corrupt checkpoint, each restart replaying steps. The last time a step ran, its ranks
    took the samples an uninterrupted run takes, each once."""
    run = fault_run(name)
    records_per_step: Counter[int] = Counter()
    final: dict[tuple[int, int], list[int]] = {}  # (rank, step) -> indices; a replayed step overwrites
    for path in sorted((run.run_dir / "samples").glob("rank*.jsonl")):
        rank = int(path.stem.removeprefix("rank"))
        for line in path.read_text().splitlines():
            record = json.loads(line)
            final[(rank, record["step"])] = record["indices"]
            records_per_step[record["step"]] += 1
    assert any(n > RANKS for n in records_per_step.values()), "the faults should have made some steps run twice"
    assert sorted({step for _, step in final}) == list(range(1, STEPS + 1))
    counts = Counter(i for indices in final.values() for i in indices)
    assert sorted(counts) == list(range(STEPS * GLOBAL_BATCH))
    assert set(counts.values()) == {1}


@pytest.mark.slow
def test_run_ends_with_the_goodput_report_and_timeline(fault_run):
    run = fault_run("ckpt-crash")
    out = run.output
    assert f"Run: completed, final step {STEPS}, 2 attempt(s)" in out
    assert "Training goodput" in out and "Infra goodput" in out
    (fault_row,) = [line for line in out.splitlines() if line.strip().startswith("1  ckpt-crash")]
    report = json.loads((run.run_dir / "report.json").read_text())
    # rank 1, in-job restart, back to the checkpoint at step 5: steps 6-10 recomputed, and those rank 0 trained
    # past 10 before it learned of the crash (none, or a few on a busy machine)
    [fault] = report["faults"]
    assert fault["steps_lost"] >= 5 and fault_row.endswith(f"{fault['steps_lost']} (back to 5)")
    assert fault_row.split()[2] == "1" and "injob" in fault_row
    assert fault["time_lost_s"] > 0 and report["final_loss"] < report["first_loss"]
    assert (run.run_dir / "timeline.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.slow
def test_corrupt_newest_checkpoint_falls_back_and_says_so(fault_run):
    run = fault_run("mixed-injob")  # step 15, the newest committed at step 18, is truncated: back to step 10
    [fallback] = events_named(run.run_dir, "ckpt_fallback")
    assert fallback["path"].endswith("step_00000015")
    assert "step_00000015 is damaged (shard file" in run.output and "is truncated" in run.output
    assert "set aside, falling back to step_00000010" in run.output
    assert list((run.run_dir / "checkpoints").glob("corrupt-step_00000015-*"))  # set aside, not retried


@pytest.mark.slow
def test_disk_full_fails_saves_clearly_and_training_goes_on(fault_run):
    run = fault_run("disk-full")
    failed = events_named(run.run_dir, "ckpt_failed")
    assert [e["step"] for e in failed] == [10, 15]
    assert all("OSError: [Errno 28] No space left on device" in e["error"] for e in failed)
    assert "checkpoint at step 10 failed, nothing made visible, training goes on" in run.output
    assert [e["step"] for e in events_named(run.run_dir, "ckpt_committed")] == [5, 20]
    assert len(events_named(run.run_dir, "attempt_start")) == 1  # no restart
    checkpoints = run.run_dir / "checkpoints"
    assert [s for s, _ in committed_checkpoints(checkpoints)] == [20, 5] and not list(checkpoints.glob(".tmp-*"))
    # injected through TRAINING_FAULTS, and recorded in the run's config
    assert events_named(run.run_dir, "run_start")[0]["config"]["faults"] == [CASES["disk-full"].spec]


@pytest.mark.slow
def test_persistent_fault_ends_the_job_after_the_restart_budget(tmp_path):
    spec, max_restarts = "exception@3:rank=1:persistent", 1
    started = time.monotonic()
    run = run_local(tmp_path / "run", *ONE_NODE.argv(), *COMMON, "checkpoint.mode=sync",
                    f"fault_tolerance.max_restarts={max_restarts}", "--faults", spec, timeout=180)
    assert run.returncode == 1, run.output[-4000:]
    assert time.monotonic() - started < 120
    assert len(events_named(run.run_dir, "fault_injected")) == max_restarts + 1  # every attempt
    assert (f"exited with code {NO_PROGRESS}: 1 in-job restart(s) in a row made no progress (no newer checkpoint; "
            "fault_tolerance.max_restarts)") in run.output
    assert f"rank 1: {spec} fired 2 time(s)" in run.output
    assert [e["status"] for e in events_named(run.run_dir, "run_end")] == ["failed"]


# Fifty faults of every kind in one run (but partition, which needs --netns), with the default budgets
# (--node-retries 3, max_restarts 3): a run that makes progress between faults never fails, however many
# it sees. Node 1 is lost four times, more than its three retries: a lost node's pod, like a drained one,
# is a disruption the Job does not count. Every restart resumes from a checkpoint newer than the last (one
# per step), so no budget of restarts in a row without progress is spent. Each group of ten: eight of
# the kinds a run sees most (five restarts, three failed saves), then one or two of the costly ones (a
# lost node or a drain: a new pod; a hang: the rank monitor's timeout).
EVERY_TEN = ("exception@{}:rank=1", "disk-full@{}:rank=0", "sigkill@{}:rank=0", "ckpt-crash@{}:rank=1",
             "disk-full@{}:rank=1", "corrupt-ckpt@{}:rank=0", "exception@{}:rank=0", "disk-full@{}:rank=0")
COSTLY = ("node-loss@{}:node=1", "disk-full@{}:rank=1", "node-loss@{}:node=1", "drain@{}:node=0",
          "node-loss@{}:node=1", "disk-full@{}:rank=0", "node-loss@{}:node=1", "hang@{}:rank=1",
          "node-loss@{}:node=0", "disk-full@{}:rank=1")
FIFTY = tuple(spec.format(3 + 3 * i) for i, spec in
              enumerate(f for group in range(5) for f in (*EVERY_TEN, *COSTLY[2 * group:2 * group + 2])))


@pytest.mark.slow
def test_fifty_faults_of_every_kind_with_the_default_budgets_run_to_completion(tmp_path):
    steps = 3 + 3 * len(FIFTY)
    run = run_local(tmp_path / "run", *TWO_NODES.argv(), "--steps", str(steps), "--faults", ",".join(FIFTY),
                    "checkpoint.interval=1", "checkpoint.mode=sync", "logging.log_interval=50",
                    f"training.collective_timeout_s={COLLECTIVE_TIMEOUT_S}",
                    "fault_tolerance.timeout_safety_factor=20", timeout=900)
    assert run.returncode == 0, run.output[-4000:]
    assert load_train_config(None).fault_tolerance.max_restarts == 3  # the default, as --node-retries' 3
    assert sorted(e["spec"] for e in events_named(run.run_dir, "fault_injected")) == sorted(FIFTY)
    assert sum(spec.startswith("node-loss") and spec.endswith("node=1") for spec in FIFTY) > 3  # > its retries
    # partition needs --netns; node-hang waits out the replacement delay a kubelet would (test_node_hang.py);
    # fs-eio lasts seconds of wall time, not a step (its run: test_full_file_system.py); lighthouse-loss needs
    # replica groups (its run: test_local_replica_groups.py)
    assert {spec.split("@")[0] for spec in FIFTY} == set(KINDS) - {"partition", "node-hang", "fs-eio",
                                                                   "lighthouse-loss"}
    assert [e["status"] for e in events_named(run.run_dir, "run_end")] == ["completed"]
    assert max(e["step"] for e in events_named(run.run_dir, "step")) == steps


# The faults of a week on a big cluster in one run, in every restart mode, with the default budgets:
# each fault fires once and the final state is the uninterrupted run's. Hangs are caught by NVRx's
# rank monitor (injob) or the in-process Wrapper, whose soft timeout the learned step timeouts must
# not undercut (both). With restart=injob, step timeouts calculated as max observed x 20 (about 5 s; NVRx
# checks every 5 s): detection well under the 30 s gloo timeout, and still no false alarm on a loaded
# 2-core box. The injob run is also the hang's and the corrupt checkpoint's own test (above).
MIXED = ("exception@3:rank=1", "sigkill@7:rank=1", "node-loss@11:node=0", "hang@14:rank=1", "corrupt-ckpt@18")
MIXED_OVERRIDES = {
    "injob": ("fault_tolerance.timeout_safety_factor=20", SAMPLE_LOG),
    "both": ("fault_tolerance.timeout_safety_factor=5", "fault_tolerance.inprocess_soft_timeout=4",
             "fault_tolerance.inprocess_hard_timeout=15"),
}
MIXED_CASES = {f"mixed-{mode}": Case(ONE_NODE, "sync", ",".join(MIXED), None,
                                     (f"fault_tolerance.restart={mode}", *overrides))
               for mode, overrides in MIXED_OVERRIDES.items()}
# With restart=injob, where each restart resumes: no checkpoint yet; 5; 10; 10 (the hang at 14); 10 (15 is corrupt)
MIXED_INJOB_RESUMED_FROM = [0, 5, 10, 10, 10]


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MIXED_OVERRIDES))
def test_mixed_faults_in_every_restart_mode_resume_exactly(mode, fault_run, reference, scratch):
    run = fault_run(f"mixed-{mode}")
    assert [e["spec"] for e in events_named(run.run_dir, "fault_injected")] == list(MIXED)
    assert [e["status"] for e in events_named(run.run_dir, "run_end")] == ["completed"]
    report = build_report(read_events(run.run_dir))
    assert [f.kind for f in report.faults if f.step is not None] == [spec.split("@")[0] for spec in MIXED]
    assert all(f.recovery_s is not None and math.isfinite(f.recovery_s) and f.recovery_s > 0 for f in report.faults)
    if mode == "injob":
        assert [f.resumed_from for f in report.faults] == MIXED_INJOB_RESUMED_FROM
        assert all(f.detection_s is not None and 0 <= f.detection_s < f.recovery_s for f in report.faults)
    else:  # the Wrapper handled the hang in place, from memory
        [hang] = [f for f in report.faults if f.kind == "hang"]
        assert hang.restart_kind == "inprocess" and hang.steps_lost is not None and hang.steps_lost <= 1
    assert_bitwise_equal(load_final_state(run.run_dir, scratch), load_final_state(reference.run_dir, scratch))


@pytest.mark.slow
def test_a_drained_node_commits_the_step_reached_and_loses_none(reference, tmp_path, scratch):
    """The controller plays the kubelet: drain marker, SIGTERM to node 1's launcher, SIGKILL only
    after the grace period. Every rank commits the step reached and leaves; the node is replaced."""
    run = run_local(tmp_path / "run", *TWO_NODES.argv(), *COMMON, "checkpoint.mode=async",
                    "--faults", "drain@12:node=1")
    assert run.returncode == 0, run.output[-4000:]
    [drained] = events_named(run.run_dir, "drained")
    assert drained["saved_step"] == drained["step"] in (12, 13)  # the step reached when the signal landed
    assert [e["step"] for e in events_named(run.run_dir, "resume")] == [0, drained["step"]]
    [fault] = build_report(read_events(run.run_dir)).faults
    assert (fault.kind, fault.steps_lost, fault.resumed_from) == ("drain", 0, drained["step"])
    assert fault.restart_kind == "node" and math.isfinite(fault.recovery_s)
    assert "outlived its grace period" not in run.output  # left on its own, well within it
    assert_bitwise_equal(load_final_state(run.run_dir, scratch), load_final_state(reference.run_dir, scratch))


@pytest.mark.slow
def test_a_drain_at_size_under_the_wrapper_leaves_the_step_with_the_partners(tmp_path):
    """The `small` preset (~58M parameters, 0.7 GB of fp32 weights and AdamW moments: the largest state
    whose steps fit this test's time here; seq_len 16 keeps its steps short, not its state small), under
    the in-process Wrapper, with peer state and no checkpoint saved yet: the drain keeps the step reached
    in the partner's memory, not on disk, and the replacement node restores it from there."""
    run = run_local(tmp_path / "run", *TWO_NODES.argv(), "--steps", "4", "model.preset=small", "training.seq_len=16",
                    "training.batch_size=1", "checkpoint.mode=async", "checkpoint.interval=100",
                    "peer_state.enabled=true", "fault_tolerance.restart=both", "logging.log_interval=1",
                    f"training.collective_timeout_s={COLLECTIVE_TIMEOUT_S}", "fault_tolerance.timeout_safety_factor=50",
                    "--faults", "drain@2:node=1", timeout=600)
    assert run.returncode == 0, run.output[-4000:]
    [drained] = events_named(run.run_dir, "drained")
    assert (drained["path"], drained["saved_step"]) == ("peers", drained["step"])
    assert drained["checkpoint_s"] is None and drained["peers_s"] is not None  # no save measured: peers fit
    resumes = events_named(run.run_dir, "resume")
    assert [(e["step"], e["source_kind"]) for e in resumes] == [(0, "none"), (drained["step"], "peer")]
    assert not committed_checkpoints(run.run_dir / "checkpoints")  # no FSx save needed
    [fault] = build_report(read_events(run.run_dir)).faults
    assert (fault.kind, fault.drain_path, fault.steps_lost) == ("drain", "peers", 0)
    assert not [e for e in events_named(run.run_dir, "restart") if e["restart_kind"] == "inprocess"]
    assert "drain (peers)" in run.output  # the goodput report says which way


@pytest.mark.slow
def test_a_drain_under_the_wrapper_waits_through_slow_saves_without_tripping_its_timeouts(tmp_path):
    """restart=both, each checkpoint write held back 8 s (FSx at size): the drain waits for the in-flight
    save, then saves the step reached, far longer than the Wrapper's soft timeout (3 s) with no progress
    to report. Neither it nor the rank that leaves first interrupts the commit: the step reached is
    committed on every rank's word, and the restart resumes there."""
    run = run_local(tmp_path / "run", *TWO_NODES.argv(), "--steps", "11", "--save-delay", "8", "checkpoint.mode=async",
                    "checkpoint.interval=4", "checkpoint.when_busy=skip", "fault_tolerance.restart=both",
                    "fault_tolerance.inprocess_soft_timeout=3", "fault_tolerance.inprocess_hard_timeout=8",
                    "logging.log_interval=1", f"training.collective_timeout_s={COLLECTIVE_TIMEOUT_S}",
                    "fault_tolerance.timeout_safety_factor=50", "--faults", "drain@10:node=1", timeout=420)
    assert run.returncode == 0, run.output[-4000:]
    [drained] = events_named(run.run_dir, "drained")
    assert (drained["path"], drained["saved_step"]) == ("checkpoint", drained["step"])
    # at least the save of the step reached (8 s): longer than the Wrapper's hard timeout, and nothing tripped
    assert drained["seconds"] > 8
    assert not [e for e in events_named(run.run_dir, "fault_detected") if "inprocess" in e["by"]]
    assert [e["step"] for e in events_named(run.run_dir, "resume")] == [0, drained["step"]]
    assert drained["step"] in [step for step, _ in committed_checkpoints(run.run_dir / "checkpoints")]
    [fault] = build_report(read_events(run.run_dir)).faults
    assert (fault.kind, fault.drain_path, fault.steps_lost) == ("drain", "checkpoint", 0)
