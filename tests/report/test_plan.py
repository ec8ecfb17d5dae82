"""Checkpoint-interval planner: the optimum against brute force, Young/Daly values, inputs."""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest

from training.plan.cli import main
from training.contract.capacity import ASYNC_SAVE_HEADROOM
from training.plan.planner import (LLAMA3_NODE_FAILURE_RATE, Mechanism, PlanError, daly_interval, expected_goodput,
                                   expected_loss_s, format_scale, make_plan, optimum_interval, young_interval)

DISK = Mechanism("injob", 17.0)
IN_MEMORY = Mechanism("inprocess", 10.0)
BENCH = {
    "checkpoint": {"async_blocking_s": 0.5, "sync_blocking_s": 8.0},
    "recovery": {name: {"median_recovery_s": r} for name, r in
                 (("inprocess", 9.0), ("injob", 17.0), ("node_replacement", 95.0), ("drain", 20.0),
                  ("k8s_restart", 270.0))},
}


@pytest.mark.parametrize("save_s, mtbf_s", [(0.5, 450_000.0), (5.0, 9000.0), (60.0, 3600.0), (1000.0, 900.0)])
def test_optimum_matches_brute_force_maximization(save_s: float, mtbf_s: float) -> None:
    taus = np.geomspace(1e-4 * mtbf_s, 10 * mtbf_s, 200_001)
    goodputs = [expected_goodput(t, save_s, DISK, mtbf_s, step_s=1.0) for t in taus]
    best = optimum_interval(save_s, mtbf_s)
    assert best == pytest.approx(taus[int(np.argmax(goodputs))], rel=1e-3)
    assert expected_goodput(best, save_s, DISK, mtbf_s, 1.0) >= max(goodputs) - 1e-12


@pytest.mark.parametrize("save_s, mtbf_s, young_s", [(5.0, 9000.0, 300.0), (2.0, 10_000.0, 200.0),
                                                     (18.0, 3600.0, 360.0)])
def test_young_values(save_s: float, mtbf_s: float, young_s: float) -> None:
    assert young_interval(save_s, mtbf_s) == pytest.approx(young_s)


@pytest.mark.parametrize("save_s, mtbf_s", [(0.5, 450_000.0), (5.0, 9000.0), (60.0, 3600.0)])
def test_daly_refines_young_towards_the_optimum(save_s: float, mtbf_s: float) -> None:
    best = optimum_interval(save_s, mtbf_s)
    assert abs(daly_interval(save_s, mtbf_s) - best) < abs(young_interval(save_s, mtbf_s) - best)
    assert daly_interval(save_s, mtbf_s) == pytest.approx(best, rel=2e-3)


def test_daly_beyond_its_range_is_the_mtbf() -> None:
    assert daly_interval(3000.0, 1000.0) == 1000.0


def test_in_memory_rollback_loses_a_step_not_half_an_interval() -> None:
    mtbf, save, step, tau = 36_000.0, 2.0, 1.5, 400.0
    # First order in 1/M: save overhead, and per failure the recovery plus half the lost segment.
    assert expected_goodput(tau, save, IN_MEMORY, mtbf, step) == pytest.approx(
        tau / (tau + save) * (1 - (IN_MEMORY.recovery_s + step / 2) / mtbf), abs=1e-7)
    same_r = Mechanism("injob", IN_MEMORY.recovery_s)
    assert expected_goodput(tau, save, same_r, mtbf, step) == pytest.approx(
        tau / (tau + save) * (1 - (IN_MEMORY.recovery_s + (tau + save) / 2) / mtbf), abs=2e-5)


def test_peer_state_resumes_from_memory_like_in_process_restart() -> None:
    mtbf, save, step, tau = 36_000.0, 2.0, 1.5, 400.0
    peer, spare = Mechanism("peer_state", 40.0), Mechanism("hot_spare", 40.0)
    assert peer.in_memory and not spare.in_memory
    assert expected_goodput(tau, save, peer, mtbf, step) > expected_goodput(tau, save, spare, mtbf, step)


def test_goodput_at_scale_uses_the_llama_3_failure_rate() -> None:
    assert LLAMA3_NODE_FAILURE_RATE == pytest.approx(1.58e-4, rel=0.01)  # 419 in 54 days on 2,048 nodes
    mechanisms = (Mechanism("peer_state", 40.0), Mechanism("k8s_restart", 700.0))
    table = format_scale(0.5, 5.0, mechanisms)
    header, peer, k8s = table.splitlines()[-3:]
    assert header.split(",")[0].strip() == "32 nodes" and "2048 nodes, 10x" in header
    values = [[float(v.rstrip("%")) / 100 for v in line.split()[1:]] for line in (peer, k8s)]
    mtbf_2048_10x = 1 / LLAMA3_NODE_FAILURE_RATE / 10 * 3600 / 2048
    assert values[1][-1] == pytest.approx(expected_goodput(
        optimum_interval(0.5, mtbf_2048_10x), 0.5, mechanisms[1], mtbf_2048_10x, 5.0), abs=5e-5)
    for row in values:  # more nodes, more failures: less goodput
        assert row[0] > row[1] > row[2] and row[3] > row[4] > row[5]
    assert all(p > k for p, k in zip(*values))


def test_make_plan_uses_the_job_mtbf() -> None:
    plan = make_plan(nodes=4, gpus_per_node=8, node_mtbf_h=10.0, save_s=5.0, step_s=1.0,
                     mechanisms=(IN_MEMORY, DISK))
    assert plan.mtbf_s == 9000.0 and plan.young_s == pytest.approx(300.0)
    assert plan.optimum_s == pytest.approx(optimum_interval(5.0, 9000.0))
    inproc, injob = (o.goodput for o in plan.outcomes)
    assert 0 < injob < inproc < 1


def test_cli_prints_interval_goodputs_and_first_failure(capsys: pytest.CaptureFixture) -> None:
    assert main(["--nodes", "4", "--node-mtbf-hours", "10", "--save-blocking-s", "5",
                 "--recovery-s", "inprocess=10", "--recovery-s", "injob=17", "--recovery-s", "k8s=270"]) == 0
    out = capsys.readouterr().out
    assert "Young  sqrt(2 S M)           300 s (5.0 min)" in out
    assert "Expected time to first failure: 9000 s (2.5 h)" in out
    assert "checkpoint.interval = 297 steps" in out
    assert "resumes from memory: loses at most the step in flight" in out
    plan_lines = out[:out.index("At scale")].splitlines()
    assert [line.split()[0] for line in plan_lines[-3:]] == ["inprocess", "injob", "k8s"]
    assert [line.split()[0] for line in out.splitlines()[-3:]] == ["inprocess", "injob", "k8s"]  # the scale table


def test_cli_single_recovery_number(capsys: pytest.CaptureFixture) -> None:
    assert main(["--nodes", "2", "--node-mtbf-hours", "100", "--save-blocking-s", "1", "--recovery-s", "60"]) == 0
    out = capsys.readouterr().out
    assert out[:out.index("At scale")].splitlines()[-1].split()[:4] == ["restart", "R", "=", "60"]


BASE = ["--nodes", "2", "--node-mtbf-hours", "100", "--save-blocking-s", "1", "--recovery-s", "60"]


@pytest.mark.parametrize("change, message", [
    ({"--nodes": "0"}, "argument --nodes: expected a positive integer, got '0'"),
    ({"--nodes": "2.5"}, "argument --nodes: expected a positive integer, got '2.5'"),
    ({"--node-mtbf-hours": "-1"}, "argument --node-mtbf-hours: expected a positive number"),
    ({"--node-mtbf-hours": "nan"}, "argument --node-mtbf-hours: expected a positive number"),
    ({"--save-blocking-s": "fast"}, "argument --save-blocking-s: expected a positive number"),
    ({"--recovery-s": "injob=0"}, "argument --recovery-s: expected a positive number"),
    ({"--recovery-s": "=5"}, "expected NAME=SECONDS"),
    ({"--save-blocking-s": None}, "give --save-blocking-s and --recovery-s, --from-bench FILE or --config FILE"),
])
def test_cli_rejects_bad_inputs(change: dict, message: str, capsys: pytest.CaptureFixture) -> None:
    args = dict(zip(BASE[::2], BASE[1::2])) | change
    argv = [item for key, value in args.items() if value is not None for item in (key, value)]
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_cli_rejects_a_mechanism_given_twice(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        main(BASE + ["--recovery-s", "restart=5"])
    assert "each mechanism once, got ['restart', 'restart']" in capsys.readouterr().err


def _bench(tmp_path: Path, data: object) -> str:
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_from_bench(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    bench = _bench(tmp_path, BENCH)
    assert main(["--nodes", "16", "--node-mtbf-hours", "2000", "--from-bench", bench]) == 0
    out = capsys.readouterr().out
    assert "Save blocking S = 0.5 s" in out
    assert f"{young_interval(0.5, 450_000.0):.0f} s" in out
    assert [line.split()[0] for line in out.splitlines()[-4:]] == [
        "inprocess", "injob", "node_replacement", "k8s_restart"]  # a drain is no failure: not planned with
    assert "drain" not in out
    assert main(["--nodes", "16", "--node-mtbf-hours", "2000", "--from-bench", bench, "--save-mode", "sync"]) == 0
    assert "Save blocking S = 8 s" in capsys.readouterr().out
    # explicit flags take precedence over the file
    assert main(["--nodes", "16", "--node-mtbf-hours", "2000", "--from-bench", bench, "--save-blocking-s", "3"]) == 0
    assert "Save blocking S = 3 s" in capsys.readouterr().out


@pytest.mark.parametrize("data, message", [
    ({"recovery": BENCH["recovery"]}, "missing key checkpoint (the expected layout is in"),
    ({**BENCH, "checkpoint": {"sync_blocking_s": 8.0}}, "missing key checkpoint.async_blocking_s"),
    ({**BENCH, "recovery": {"injob": {"mean_recovery_s": 17.0}}}, "missing key recovery.injob.median_recovery_s"),
    ({**BENCH, "recovery": {}}, "recovery: expected an object of mechanisms"),
    ({**BENCH, "recovery": {"injob": {"median_recovery_s": -1}}},
     "recovery.injob.median_recovery_s: expected a positive number, got -1"),
    ([1, 2], "missing key checkpoint"),
])
def test_from_bench_errors_name_the_key(tmp_path: Path, capsys: pytest.CaptureFixture, data, message: str) -> None:
    bench = _bench(tmp_path, data)
    with pytest.raises(SystemExit) as exit_:
        main(["--nodes", "1", "--node-mtbf-hours", "1", "--from-bench", bench])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith(f"error: {bench}: ") and message in err


def test_from_bench_unreadable(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "bench.json").write_text("{not json")
    cases = ((tmp_path / "absent.json", "cannot read bench result"), (tmp_path / "bench.json", "not JSON"))
    for path, message in cases:
        with pytest.raises(SystemExit):
            main(["--nodes", "1", "--node-mtbf-hours", "1", "--from-bench", str(path)])
        assert message in capsys.readouterr().err


def test_goodput_is_a_probability() -> None:
    for tau in (1.0, 100.0, 1e4):
        g = expected_goodput(tau, 5.0, DISK, 9000.0, 1.0)
        assert 0 < g < 1 and math.isfinite(g)


REPO = Path(__file__).resolve().parents[2]


def test_config_plans_with_the_capacity_models_save_step_and_recoveries(capsys: pytest.CaptureFixture) -> None:
    """The Job's config on 2 p5 nodes against cdk.json's FSx: the capacity table, then an interval from the
    modelled save (0.24 s of staging blocks the step) and R from the modelled restores (a peer restore checks each copy's CRC-32)."""
    assert main(["--nodes", "2", "--config", str(REPO / "k8s" / "train.yaml"),
                 "--cdk-json", str(REPO / "cdk.json")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Capacity (projected")
    assert "save to FSx  82 s; blocks the step 0.24 s (async)" in out
    assert "every promise holds at this size" in out
    assert "Save blocking S = 0.240908 s, commit lag D = 82.2299 s, step time 1.06587 s" in out
    assert re.search(r"injob\s+R =\s+129.23 s", out) and re.search(r"peer_state\s+R = 64.3577 s", out)


def test_an_interval_without_headroom_over_the_save_is_never_recommended(capsys: pytest.CaptureFixture) -> None:
    """256 nodes fail often: the optimum for a 2 ms stall (18 s) is shorter than the 82 s save, which must commit
    before the next is due with room for a slower one; and every failure loses the save's commit lag beside half
    the interval."""
    assert main(["--nodes", "256", "--config", str(REPO / "k8s" / "train.yaml"), "--fsx-storage-gib", "1200",
                 "--fsx-throughput-per-tib", "1000", "--cdk-json", "/nonexistent"]) == 0
    out = capsys.readouterr().out
    save_s, step_s = 82.2299, 1.06587
    steps = int(re.search(r"<- use this, the optimum leaves a save no time to commit: checkpoint.interval = (\d+) "
                          r"steps", out)[1])
    assert steps == math.ceil(ASYNC_SAVE_HEADROOM * save_s / step_s) == 116 and steps * step_s > 1.4 * save_s
    lost_s = float(re.search(r"injob .* loses (\d+) s", out)[1])
    assert lost_s == pytest.approx(ASYNC_SAVE_HEADROOM * save_s / 2 + save_s, abs=0.5)  # 144 s, not 62 s


def _loss_by_simulation(interval_s: float, save_s: float, lag_s: float, samples: int, seed: int) -> np.ndarray:
    """Failures landing uniformly in time over periodic saves: save k blocks training until k * period and
    commits lag_s after that; a failure resumes from the newest committed save and loses the time since its
    blocking ended."""
    period = interval_s + save_s
    saves = 1000
    blocking_ends = period * np.arange(saves)
    commits = blocking_ends + lag_s
    failures = np.random.default_rng(seed).uniform(2 * period, (saves - 2) * period, samples)
    newest_committed = np.searchsorted(commits, failures, side="right") - 1
    return failures - blocking_ends[newest_committed]


@pytest.mark.parametrize("interval_s, save_s, lag_s", [
    (123.3, 0.002, 82.2),  # 8b on 256 nodes: the recommended interval over an 82 s async save
    (83.1, 0.002, 82.2),   # the interval the planner recommended before: the save committed just in time
    (300.0, 5.0, 0.0),     # sync: a checkpoint commits when its save stops blocking
])
def test_expected_loss_per_failure_matches_a_monte_carlo_of_periodic_saves(interval_s, save_s, lag_s) -> None:
    lost = _loss_by_simulation(interval_s, save_s, lag_s, samples=4000, seed=34)
    planned = expected_loss_s(interval_s, save_s, DISK, step_s=1.0, commit_lag_s=lag_s)
    assert planned == pytest.approx(lost.mean(), abs=4 * lost.std() / math.sqrt(lost.size))
    assert lost.max() <= interval_s + save_s + lag_s  # the capacity model's worst case bounds every sample


def test_the_commit_lag_costs_goodput_like_recovery_time_and_not_in_memory_rollback() -> None:
    """To first order in 1/M, G = tau/(tau+S) (1 - (R + loss)/M): the goodput charges each failure the loss the
    Monte Carlo above checks. The lag does not move the optimum, and in-memory rollback never waits for a commit."""
    mtbf, save, tau, lag = 3.6e6, 0.5, 200.0, 80.0
    for mechanism in (DISK, IN_MEMORY):
        loss = expected_loss_s(tau, save, mechanism, 1.0, lag)
        assert expected_goodput(tau, save, mechanism, mtbf, 1.0, lag) == pytest.approx(
            tau / (tau + save) * (1 - (mechanism.recovery_s + loss) / mtbf), abs=1e-8)
    assert expected_goodput(tau, save, DISK, mtbf, 1.0, lag) == pytest.approx(
        expected_goodput(tau, save, Mechanism("injob", DISK.recovery_s + lag), mtbf, 1.0))
    taus = np.linspace(1.01 * lag, 20 * lag, 20_001)
    goodputs = [expected_goodput(t, 2.0, DISK, 9000.0, 1.0, lag) for t in taus]
    assert taus[int(np.argmax(goodputs))] == pytest.approx(optimum_interval(2.0, 9000.0), rel=1e-3)


def test_goodput_with_a_lag_matches_a_monte_carlo_of_exponential_failures() -> None:
    """The exact model: after each recovery (failures strike it too) the first checkpoint commits tau + S + D
    later and each next one tau + S after the one before; a failure keeps tau per commit. A job MTBF of a few
    intervals makes the lag's cost (e^(-D/M), 12% here) far larger than the sampling error."""
    tau, save, lag, mtbf, recovery = 100.0, 1.0, 80.0, 600.0, 30.0
    rng = np.random.default_rng(34)
    cycles = 20_000
    wall = 0.0
    for _ in range(cycles):  # recovery: every attempt a failure cuts short is lost too
        while (attempt := rng.exponential(mtbf)) < recovery:
            wall += attempt
        wall += recovery
    runs = rng.exponential(mtbf, cycles)
    commits = np.maximum(np.floor((runs - lag) / (tau + save)), 0)
    simulated = tau * commits.sum() / (wall + runs.sum())
    planned = expected_goodput(tau, save, Mechanism("injob", recovery), mtbf, 1.0, commit_lag_s=lag)
    assert planned == pytest.approx(simulated, rel=0.02)
    assert expected_goodput(tau, save, Mechanism("injob", recovery), mtbf, 1.0) > 1.1 * simulated  # lag left out


def test_a_lag_longer_than_the_interval_is_refused() -> None:
    with pytest.raises(PlanError, match="commit lag 90 s is longer than the interval 60 s plus the save's blocking"):
        expected_goodput(60.0, 1.0, DISK, 9000.0, 1.0, commit_lag_s=90.0)


def test_cli_commit_lag_sets_the_shortest_interval_and_the_loss(capsys: pytest.CaptureFixture) -> None:
    assert main(BASE + ["--nodes", "2048", "--commit-lag-s", "60"]) == 0
    out = capsys.readouterr().out
    assert "commit lag D = 60 s" in out and "async save duration x 1.5    90.0 s  <- use this" in out
    assert "checkpoint.interval = 90 steps" in out and "loses 105.5 s per failure" in out  # (90 + 1) / 2 + 60


def test_config_without_fsx_names_the_flags(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--nodes", "2", "--config", str(REPO / "k8s" / "train.yaml"), "--cdk-json", str(tmp_path / "none")])
    assert exit_.value.code == 2 and "give --fsx-storage-gib and --fsx-throughput-per-tib" in capsys.readouterr().err


def test_config_refuses_a_gpu_count_the_capacity_model_does_not_size(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--nodes", "2", "--gpus-per-node", "4", "--config", str(REPO / "k8s" / "train.yaml"),
              "--cdk-json", str(REPO / "cdk.json")])
    assert exit_.value.code == 2
    assert "--gpus-per-node 4 does not go with --config: the capacity model sizes p5.48xlarge nodes (8 GPUs each)" \
        in capsys.readouterr().err


def test_docs_capacity_tables_are_the_models_output(capsys: pytest.CaptureFixture) -> None:
    assert main(["--capacity-tables"]) == 0
    tables = capsys.readouterr().out.strip()
    page = (REPO / "docs" / "capacity.md").read_text()
    capacity, hsdp = tables.split("\n\n")
    assert capacity.startswith("| model | nodes | FSx GiB") and hsdp.startswith("| model | nodes | GPU state GB")
    for table in (capacity, hsdp):
        assert table in page, "docs/capacity.md differs from `python -m training.plan --capacity-tables`"


def _replica_group_goodput_by_simulation(groups: int, recovery_s: float, stall_s: float, mtbf_s: float,
                                         step_s: float, wall_s: float, seed: int) -> float:
    """Failures of the job at rate 1/M, each on a group drawn at random: every group loses the step in flight,
    the failed one then recovery_s (a failure while it recovers starts its recovery over), the others stall_s.
    Goodput is the GPU-time outside every group's lost intervals."""
    rng = np.random.default_rng(seed)
    times = np.cumsum(rng.exponential(mtbf_s, int(2 * wall_s / mtbf_s)))
    times = times[times < wall_s]
    in_flight = rng.uniform(0, step_s, times.size)
    failed = rng.integers(groups, size=times.size)
    lost = 0.0
    for g in range(groups):
        end = -math.inf
        for t, flight, f in zip(times, in_flight, failed):
            start, stop = t - flight, t + (recovery_s if f == g else stall_s)
            lost += stop - max(start, end) if stop > end else 0.0
            end = max(end, stop)
    return 1 - lost / (groups * wall_s)


def test_replica_groups_goodput_counts_gpu_time_as_a_simulation_of_the_groups_does() -> None:
    """A failure stops one group of R for its recovery and stalls the others: by GPU-time, R is
    (recovery + (R-1) stall) / R, and a heal from live state loses only the step in flight."""
    groups, recovery, stall, mtbf, step = 4, 60.0, 10.0, 2000.0, 2.0
    mechanism = Mechanism("replica_groups", recovery, groups, stall)
    assert mechanism.gpu_recovery_s == pytest.approx((60 + 3 * 10) / 4)
    simulated = _replica_group_goodput_by_simulation(groups, recovery, stall, mtbf, step, 2e7, seed=37)
    planned = expected_goodput(100.0, 0.0, mechanism, mtbf, step)
    assert planned == pytest.approx(simulated, abs=1e-3)
    every_gpu_stops = expected_goodput(100.0, 0.0, Mechanism("injob", recovery), mtbf, step)
    assert planned - every_gpu_stops > 0.01  # what the groups buy: 22.5 s of every GPU per failure, not 60 s


REPLICA = ["--recovery-s", "peer_state=48", "--recovery-s", "replica_groups=54", "--survivor-stall-s", "11"]


def test_cli_plans_replica_groups_at_scale(capsys: pytest.CaptureFixture) -> None:
    assert main(["--nodes", "2048", "--save-blocking-s", "0.5", "--commit-lag-s", "60", "--step-s", "5", *REPLICA,
                 "--replica-groups", "4"]) == 0
    out = capsys.readouterr().out
    assert "replica_groups  R =      54 s for 1 of 4 groups, 11 s for the others: 21.8 s per GPU" in out
    assert "heals from a live group: loses at most the step in flight" in out
    header, peer, replicas = out.splitlines()[-3:]
    assert header.split()[-3:] == ["2048", "nodes,", "10x"]
    assert float(replicas.split()[-1].rstrip("%")) > float(peer.split()[-1].rstrip("%"))


@pytest.mark.parametrize("extra, message", [
    (["--recovery-s", "replica_groups=54"],
     "--recovery-s replica_groups: give the other groups' stall per failure with --survivor-stall-s SECONDS"),
    (["--recovery-s", "injob=17", "--replica-groups", "4"], "--replica-groups and --survivor-stall-s plan the replica_groups mechanism"),
    ([*REPLICA, "--replica-groups", "1"], "--replica-groups 1: expected 2 or more"),
])
def test_cli_refuses_replica_groups_it_cannot_plan(extra: list[str], message: str,
                                                   capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--nodes", "2048", "--save-blocking-s", "0.5", *extra])
    assert exit_.value.code == 2 and f"error: {message}" in capsys.readouterr().err


def test_from_bench_plans_the_replica_group_row_with_its_survivors_stall(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture) -> None:
    data = {**BENCH, "recovery": {**BENCH["recovery"],
                                  "replica_groups": {"median_recovery_s": 12.0, "median_survivor_stall_s": 1.1}}}
    bench = _bench(tmp_path, data)
    assert main(["--nodes", "16", "--from-bench", bench]) == 0
    assert "R =      12 s for 1 of 2 groups, 1.1 s for the others: 6.5 s per GPU" in capsys.readouterr().out
    assert main(["--nodes", "16", "--from-bench", bench, "--replica-groups", "8"]) == 0
    assert "for 1 of 8 groups" in capsys.readouterr().out
