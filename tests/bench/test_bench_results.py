"""The bench's figures from synthetic inputs: stall analysis, rollback cost, checks, JSON (with plan --from-bench),
table, plot."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from bench_samples import mechanism, sample_result, stall_pass, write_events

from bench import run
from bench.checks import SPARE_CPU_FIGURE, recovery_checks, rollback_checks, spare_cpu_checks, stall_checks
from bench.floor import FloorResult
from bench.plot import plot_result
from bench.profile import ALL, FULL, QUICK
from bench.results import SCHEMA, write_json
from bench.rollback import cost_per_step, measure_rollback
from bench.stall import CALIBRATED_SYNC_COST, StallSpec, analyse, calibrated_interval, spare_cpu_world, step_wall_s
from bench.table import format_markdown
from training.plan import planner as plan
from training.plan.cli import main as plan_main


def test_stall_figures_come_from_the_event_logs(tmp_path: Path) -> None:
    # 21 steps of 0.1 s; saves after steps 10 and 20 block 1.0 s (sync) or 0.05 s (async).
    dirs = {"off": stall_pass(tmp_path / "off", 21, 0.1, {}),
            "sync": stall_pass(tmp_path / "sync", 21, 0.1, {10: 1.0, 20: 1.0}),
            "async": stall_pass(tmp_path / "async", 21, 0.1, {10: 0.05, 20: 0.05})}
    walls = {mode: step_wall_s(path) for mode, path in dirs.items()}
    # a rank's CPU time per round; the first async round also allocates the staging buffers
    s = analyse(dirs, walls, state_bytes=1 << 28, world=2, interval=10, steps=21,
                cpu_per_round={"off": [1.0, 1.1, 0.9], "sync": [2.0, 2.1, 1.8], "async": [3.0, 1.6, 1.4]},
                writer_cpu_per_round=[0.9, 0.7, 0.8])
    assert s.sync_blocking_s == pytest.approx(1.0) and s.async_blocking_s == pytest.approx(0.05)
    assert s.blocking_ratio == pytest.approx(0.05)
    assert s.step_wall_off_s == pytest.approx(0.1)
    assert s.step_wall_sync_s == pytest.approx((20 * 0.1 + 2.0) / 20)
    assert s.efficiency_sync == pytest.approx(2.0 / 4.0)
    assert s.efficiency_async == pytest.approx(2.0 / 2.1)
    assert s.cpu_per_save_sync_s == pytest.approx(1.0) and s.cpu_per_save_async_s == pytest.approx(0.5)
    assert s.writer_cpu_per_save_async_s == pytest.approx(0.8)  # the writer process's, apart from the rank's
    assert s.rank_cpu_ratio == pytest.approx(0.5)


def test_an_async_miss_names_the_cpu_time_a_save_still_costs() -> None:
    missed = replace(sample_result().checkpoint, efficiency_async=0.6, cpu_per_save_sync_s=2.01,
                     cpu_per_save_async_s=1.93)
    checks = {c.figure: c for c in stall_checks(missed, "", cpus=2)}
    efficiency = checks["training efficiency, async checkpoints"]
    assert efficiency.status == "MISS"
    assert efficiency.note == ("an async save still costs a rank 1.93 CPU-s (sync: 2.01), blocking it 0.10 s, and its "
                               "writer process 0.40 CPU-s, and 2 ranks keep all 2 CPUs busy: none is spare for the "
                               "background write")
    assert checks["training efficiency, async checkpoints (target)"].note == efficiency.note
    with_spare_cpus = {c.figure: c for c in stall_checks(missed, "", cpus=16)}["training efficiency, async checkpoints"]
    assert with_spare_cpus.note == ("an async save still costs a rank 1.93 CPU-s (sync: 2.01), blocking it 0.10 s, and "
                                    "its writer process 0.40 CPU-s")
    rank_cpu = checks["CPU time a save charges the training rank, async / sync"]
    assert (rank_cpu.status, rank_cpu.note) == ("MISS", "async: 1.93 CPU-s on the rank, the staging copy of its 128 MiB "
                                                        "shard among them, blocking it 0.10 s; sync: 2.01 CPU-s")
    passed = {c.figure: c for c in stall_checks(sample_result().checkpoint, "", cpus=2)}
    assert passed["training efficiency, async checkpoints"].note == ""
    assert passed["CPU time a save charges the training rank, async / sync"].status == "PASS"  # 0.045 / 0.5


@pytest.mark.parametrize("efficiency, busy, spare", [(0.84, "MISS", "MISS"), (0.86, "PASS", "MISS"),
                                                     (0.96, "PASS", "PASS")])
def test_async_efficiency_targets_are_85_percent_all_cpus_busy_and_95_with_one_spare(efficiency, busy, spare) -> None:
    s = replace(sample_result().checkpoint, efficiency_async=efficiency)
    assert {c.figure: c.status for c in stall_checks(s, "", cpus=2)}[
        "training efficiency, async checkpoints (target)"] == busy
    assert {c.figure: c.status for c in spare_cpu_checks(s, "", 2, run=True)}[
        f"training efficiency, async checkpoints{SPARE_CPU_FIGURE} (target)"] == spare


def test_a_gpu_pass_has_no_cpu_figures_to_judge() -> None:
    gpu = replace(sample_result().checkpoint, cpu_per_save_sync_s=None, cpu_per_save_async_s=None,
                  writer_cpu_per_save_async_s=None)
    rank_cpu = {c.figure: c for c in stall_checks(gpu, "", cpus=2)}["CPU time a save charges the training rank, async / sync"]
    assert (rank_cpu.status, rank_cpu.note) == ("N/A", "CPU time not measured (GPU pass)")


def test_a_second_stall_pass_leaves_one_cpu_spare_only_where_the_first_left_none() -> None:
    assert spare_cpu_world(world=2, cpus=2) == 1
    assert spare_cpu_world(world=4, cpus=4) == 3
    assert spare_cpu_world(world=2, cpus=16) is None  # the first pass already has spare CPUs
    assert spare_cpu_world(world=1, cpus=1) is None  # nothing to leave spare


def test_calibrated_interval_makes_sync_saves_cost_the_target_share() -> None:
    interval = calibrated_interval(step_s=0.1, save_s=2.0)
    assert 2.0 / (interval * 0.1 + 2.0) == pytest.approx(CALIBRATED_SYNC_COST, abs=0.01)
    assert calibrated_interval(step_s=1.0, save_s=0.01) == 5 and calibrated_interval(1e-3, 100.0) == 100


def _inprocess_steps(run_dir: Path, rollback_s: list[float], step_s: list[float]) -> Path:
    records = [{"t": float(i), "event": "step", "step": i, "loss": 0.0, "step_time_s": s, "tokens": 0,
                **({"rollback_s": r} if r is not None else {})}
               for i, (r, s) in enumerate(zip(rollback_s, step_s, strict=True), start=1)]
    return write_events(run_dir, [{"t": 0.0, "event": "resume", "step": 0, "source_kind": "none"}, *records])


def test_rollback_cost_comes_from_the_inprocess_runs_step_events(tmp_path: Path) -> None:
    # the first save also allocates the buffers: the median leaves it out
    run_dir = _inprocess_steps(tmp_path / "inprocess", [0.05, 0.001, 0.002, 0.0015], [0.04, 0.02, 0.03, 0.025])
    assert cost_per_step(run_dir) == (pytest.approx(0.00175), pytest.approx(0.0275), 4)
    r = measure_rollback(run_dir, copy_bytes=4 << 20, device="cpu")  # and a 4 MiB shard really saved
    assert r.cost_ratio == pytest.approx(0.00175 / 0.0275) and r.steps == 4
    assert r.copy_s > 0 and r.copy_gbps == pytest.approx((4 << 20) / r.copy_s / 1e9)
    injob = _inprocess_steps(tmp_path / "injob", [None, None], [0.02, 0.02])
    with pytest.raises(ValueError, match="no step event has rollback_s"):
        cost_per_step(injob)


def _by_figure(checks) -> dict[str, str]:
    return {c.figure: c.status for c in checks}


def test_checks_pass_and_miss_against_targets() -> None:
    floor = FloorResult(4.0, (4.0,), 2)
    good = _by_figure(recovery_checks({"inprocess": mechanism(3.0, steps_lost=1), "injob": mechanism(7.0),
                                       "drain": mechanism(4.0, steps_lost=0)}, {}, floor, ALL))
    assert good["in-process recovery / in-job recovery"] == "PASS"
    assert good["inprocess steps lost per fault (max)"] == "PASS"
    assert good["drain steps lost per fault (max)"] == "PASS"
    assert good["in-job recovery / floor (fresh Python + import torch + join group)"] == "PASS"
    assert good["injob median recovery"] == "PASS"
    bad = _by_figure(recovery_checks({"inprocess": mechanism(5.0, steps_lost=3), "injob": mechanism(9.0),
                                      "drain": mechanism(4.0, steps_lost=1), "k8s_restart": mechanism(13.0)}, {},
                                     floor, ALL))
    assert bad["in-process recovery / in-job recovery"] == "MISS"
    assert bad["inprocess steps lost per fault (max)"] == "MISS"
    assert bad["drain steps lost per fault (max)"] == "MISS"
    assert bad["in-job recovery / floor (fresh Python + import torch + join group)"] == "MISS"
    assert bad["k8s_restart median recovery"] == "BASELINE"
    nodes = _by_figure(recovery_checks({"injob": mechanism(3.0), "node_replacement": mechanism(3.0),
                                        "node_zero": mechanism(4.0), "hot_spare": mechanism(4.5)}, {}, floor, ALL))
    assert nodes["node 0 loss recovery / other node loss recovery"] == "PASS"
    assert nodes["hot spare recovery / in-job recovery"] == "PASS"
    nodes = _by_figure(recovery_checks({"injob": mechanism(3.0), "node_replacement": mechanism(3.0),
                                        "node_zero": mechanism(10.0), "hot_spare": mechanism(4.6)}, {}, floor, ALL))
    assert nodes["node 0 loss recovery / other node loss recovery"] == "MISS"  # node 0 still special
    assert nodes["hot spare recovery / in-job recovery"] == "MISS"
    partition = "partition detection (NVRx timeouts), median"
    assert _by_figure(recovery_checks({"partition": mechanism(7.0)}, {}, floor, ALL))[partition] == "PASS"
    assert _by_figure(recovery_checks({"partition": replace(mechanism(40.0), median_detection_s=31.0)}, {}, floor,
                                      ALL))[partition] == "MISS"  # gloo's timeout, not NVRx, ended the wait
    both = _by_figure(recovery_checks({"node_zero": mechanism(6.6), "node_zero_both": mechanism(9.0),
                                       "partition": mechanism(13.0), "partition_both": mechanism(101.7),
                                       "hang": replace(mechanism(4.0), median_detection_s=3.7),
                                       "hang_both": replace(mechanism(31.0), median_detection_s=30.1)}, {}, floor, ALL))
    assert both["node_zero_both recovery / node_zero recovery"] == "PASS"
    assert both["partition_both recovery / partition recovery"] == "MISS"  # the Wrapper waited out its timeouts
    assert both["hang_both detection / hang detection"] == "MISS"  # gloo's timeout, not a section timeout
    rollback = sample_result().rollback
    assert [c.status for c in rollback_checks(replace(rollback, cost_ratio=0.05), "")] == ["PASS"]
    assert [c.status for c in rollback_checks(replace(rollback, cost_ratio=0.08), "")] == ["MISS"]


def test_missing_parts_are_not_available_with_the_reason() -> None:
    checks = recovery_checks({"injob": mechanism(7.0)}, {"inprocess": "no module"}, None, ("inprocess", "injob"))
    ratio = next(c for c in checks if c.figure == "in-process recovery / in-job recovery")
    assert (ratio.status, ratio.note) == ("N/A", "inprocess: no module")
    assert not any("k8s_restart" in c.figure or "drain" in c.figure for c in checks)  # not in this profile: no check
    drain = next(c for c in recovery_checks({}, {"drain": "no replacement"}, None, ("drain",)) if "drain" in c.figure)
    assert (drain.status, drain.note) == ("N/A", "drain: no replacement")
    assert {c.status for c in stall_checks(None, "disk full", cpus=2)} == {"N/A"}
    assert [(c.status, c.note) for c in spare_cpu_checks(None, "disk full", 2, run=True)] == [("N/A", "disk full")] * 4
    assert spare_cpu_checks(None, "", 2, run=False) == []  # not run (a spare CPU already, or GPU): no check
    assert [(c.status, c.note) for c in rollback_checks(None, "no in-process run")] == [("N/A", "no in-process run")]


def test_json_has_the_keys_plan_reads_and_plan_runs_from_it(tmp_path: Path, capsys) -> None:
    path = write_json(sample_result(), tmp_path / "r.json")
    data = json.loads(path.read_text())
    assert data["schema"] == SCHEMA
    assert set(data["recovery"]) == {"injob", "node_replacement", "hot_spare", "peer_state", "drain",
                                     "k8s_restart", "replica_groups"}  # unavailable ones stay out
    assert [p["mechanism"] for p in data["projections"]] == ["hot_spare", "peer_state", "node_replacement",
                                                              "node_replacement", "node_replacement", "k8s_restart",
                                                              "replica_groups", "replica_groups"]
    assert data["recovery"]["replica_groups"]["median_survivor_stall_s"] == 1.2
    assert data["peer"]["cost_ratio"] == 0.03 and data["peer"]["bytes_per_rank"] == 4 << 20
    assert [(s["preset"], s["send_s"]) for s in data["peer_sizes"]] == [("tiny", 0.01), ("small", 2.0)]
    assert data["delays"]["toleration_s"] == 30
    assert data["unavailable"] == {"inprocess": "training/train/inprocess.py does not exist"}
    assert {c["status"] for c in data["checks"]} <= {"PASS", "MISS", "BASELINE", "N/A"}
    assert data["rollback"]["cost_ratio"] == 0.04 and data["rollback"]["copy_gbps"] == 5.37
    save, mechanisms = plan.from_bench(path, "async")
    assert save == 0.1 and {m.name: m.recovery_s for m in mechanisms} == {  # a drain is no failure to plan for
        "injob": 7.0, "node_replacement": 20.0, "hot_spare": 10.0, "peer_state": 9.0, "k8s_restart": 13.0,
        "replica_groups": 8.0}
    assert [(m.groups, m.survivor_stall_s) for m in mechanisms if m.name == "replica_groups"] == [(2, 1.2)]
    assert plan_main(["--nodes", "32", "--node-mtbf-hours", "2000", "--from-bench", str(path)]) == 0
    assert "k8s_restart" in capsys.readouterr().out


def test_markdown_and_png(tmp_path: Path) -> None:
    result = sample_result()
    text = format_markdown(result)
    assert "| in-process restart | not available: training/train/inprocess.py does not exist |" in text
    assert "| plain Kubernetes restart (every pod replaced) | 2/2 |" in text
    assert "| node lost (SIGKILL), replaced | 2/2 | 1.00 s | 20.00 s | - | 4/4 |" in text
    assert "| node drained (SIGTERM), replaced | 2/2 | 1.00 s | 4.00 s | - | 0/0 | 4.00 s | - |" in text
    assert ("| node lost, replica groups (the other group trains on) | 2/2 | 1.00 s | 8.00 s | - | 0/0 | 8.00 s | "
            "1.20/1.50 s | 50.0% |") in text
    assert ("| replica_groups other groups' longest stall across a fault (median) | 1.20 s | <= 3 s | target | PASS |"
            in text)
    assert ("| step time, 2 replica groups / 1 (same ranks and global batch; HSDP's overhead) | 1.25x | measured | "
            "target | BASELINE |") in text
    # on EKS no TCP reset ends the all-reduce with the lost node: torchft's timeout does
    assert "| replica_groups other groups' stall, projected on EKS | 9.20 s | <= 10 s | target | PASS |" in text
    assert "| drain steps lost per fault (max) | 0 steps | <= 0 | target | PASS |" in text
    assert "Quick mode: 2 faults per mechanism" in text
    assert "| sync | 2.00 s | 2.00, 2.00 | 0.50 s | - (the rank writes) | 0.20 s | 50.0% |" in text
    assert "| async | 0.10 s | 0.10, 0.10 | 0.04 s | 0.40 s | 0.10 s | 99.0% |" in text
    spare_title = ("Checkpoint stall on one rank fewer, the same shard per rank, leaving a CPU spare for the "
                   "background writer as a GPU host's idle cores do")
    spare = text[text.index(f"{spare_title}: 128 MiB of state over 1 rank(s) (one rank: no all-reduce peer"):]
    assert "| sync | 1.50 s | 1.50, 1.50 | 0.50 s | - (the rank writes) | 0.20 s | 60.0% |" in spare
    assert ("| training efficiency, async checkpoints, one CPU spare for the writer | 90.0% | >= 99% | AWS post "
            "(2-8 p5 nodes) | MISS (an async save still costs a rank 0.04 CPU-s (sync: 0.50), blocking it 0.10 s, and "
            "its writer process 0.40 CPU-s) |") in text
    assert ("the async writer's one-time start (its process, its staging buffers allocated; in training, in the "
            "background from the first step on): 1.20 s, before the first round and counted in no mode") in text
    assert ("| CPU time a save charges the training rank, async / sync, one CPU spare for the writer | 0.09x | "
            "<= 0.10 | target | PASS |") in text
    failed = format_markdown(replace(result, checkpoint_spare_cpu=None,
                                     unavailable={"checkpoint_spare_cpu": "disk full"}))
    assert f"{spare_title}: not measured (disk full)" in failed
    assert "| 1.20 ms | 30.0 ms | 4.0% | 25.0 ms | 5.4 GB/s |" in text  # in-memory rollback
    assert ("| in-memory rollback per step / step time (in-process run) | 4.0% | <= 5% | target | PASS |"
            in text)
    no_rollback = format_markdown(replace(result, rollback=None, unavailable={"rollback": "disk full"}))
    assert "In-memory rollback (training.train.rollback): not measured (disk full)" in no_rollback
    assert "PASS" in text and "BASELINE" in text and "~270 s" in text
    assert "Projection, not a measurement: a lost p5 node on EKS" in text
    assert "| hot spare (spare node and standby pod): this repository's default | 50 s |" in text
    assert "| 1.50 ms | 50.0 ms | 3.0% | 1 step(s) | 1 | 4.0 MiB |" in text  # peer state
    assert "| peer state copy per step / step time (peer-state run) | 3.0% | <= 5% | target | PASS |" in text
    assert "| small | 300.0 MiB | 0.40 s | 2.00 s | 3.00 s | 1.00 s (0.31 GB/s) | 300x | 200x | 200x | 30x |" in text  # growth, measured
    no_sizes = format_markdown(replace(result, peer_sizes=(), unavailable={"peer_sizes": "/dev/shm full"}))
    assert "Peer state as the state grows (bench.peer_sizes): not measured (/dev/shm full)" in no_sizes
    png = plot_result(result, tmp_path / "r.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _fake_peer_sizes(presets):
    return sample_result().peer_sizes


@pytest.mark.parametrize("cpus, spare_world", [(2, 1), (16, None)])
def test_the_spare_cpu_stall_pass_runs_where_the_first_pass_leaves_no_cpu_spare(monkeypatch, tmp_path: Path, cpus,
                                                                                 spare_world) -> None:
    specs = []

    def fake_stall(spec: StallSpec, root: Path):
        specs.append((spec, root))
        return replace(sample_result().checkpoint, world_size=spec.world, state_bytes=spec.state_bytes,
                       efficiency_async=0.9 if spec.world == 1 else 0.6)

    monkeypatch.setattr(run.os, "cpu_count", lambda: cpus)
    monkeypatch.setattr(run, "measure_stall", fake_stall)
    monkeypatch.setattr(run, "measure_floor", lambda world, repeats: FloorResult(1.0, (1.0,), world))
    monkeypatch.setattr(run, "measure_peer_sizes", _fake_peer_sizes)  # real: ~20 s at the small preset's state
    profile = replace(FULL, mechanisms=())
    result = run.run_bench(profile, tmp_path, "2026-11-30_000000")
    assert specs[0][0] == StallSpec(FULL.state_bytes, 2, FULL.stall_saves, FULL.matmuls_per_step, "cpu")
    spare_figures = [c.figure for c in result.checks if SPARE_CPU_FIGURE in c.figure]
    values = {c.figure: c.measured for c in result.checks}
    assert values["training efficiency, async checkpoints"] == 0.6  # the first pass's, 2 ranks
    assert result.peer_sizes == sample_result().peer_sizes
    if spare_world is None:
        assert len(specs) == 1 and result.checkpoint_spare_cpu is None and spare_figures == []
        return
    spare_spec, spare_root = specs[1]
    assert (spare_spec.world, spare_spec.state_bytes) == (1, FULL.state_bytes // 2)  # the same shard per rank
    assert spare_root != specs[0][1]  # its own run directories
    assert result.checkpoint_spare_cpu.world_size == 1
    assert spare_figures == [f"training efficiency, async checkpoints{SPARE_CPU_FIGURE}",
                             f"training efficiency, async checkpoints{SPARE_CPU_FIGURE} (target)",
                             f"training efficiency, sync checkpoints{SPARE_CPU_FIGURE}",
                             f"CPU time a save charges the training rank, async / sync{SPARE_CPU_FIGURE}"]
    assert values[f"training efficiency, async checkpoints{SPARE_CPU_FIGURE}"] == 0.9  # the spare pass's, 1 rank
    assert run.run_bench(replace(profile, stall_spare_cpu=False), tmp_path, "x").checkpoint_spare_cpu is None


def test_the_rollback_cost_is_measured_on_the_inprocess_run(monkeypatch, tmp_path: Path) -> None:
    measured = []
    monkeypatch.setattr(run, "measure_stall", lambda spec, root: sample_result().checkpoint)
    monkeypatch.setattr(run, "measure_floor", lambda world, repeats: FloorResult(1.0, (1.0,), world))
    monkeypatch.setattr(run, "measure_mechanism", lambda m, p, run_dir: replace(mechanism(1.0), run_dir=str(run_dir)))
    monkeypatch.setattr(run, "measure_rollback", lambda *args: measured.append(args) or sample_result().rollback)
    monkeypatch.setattr(run, "measure_peer_sizes", _fake_peer_sizes)
    result = run.run_bench(replace(QUICK, mechanisms=("inprocess", "injob")), tmp_path, "x")
    assert measured == [(tmp_path / "inprocess", QUICK.rollback_copy_bytes, "cpu")]
    assert result.rollback == sample_result().rollback
    without = run.run_bench(replace(QUICK, mechanisms=("injob",)), tmp_path, "y")
    [check] = [c for c in without.checks if "rollback" in c.figure]
    assert (without.rollback, check.status, check.note) == (None, "N/A", "needs the in-process run (not run)")
