"""The preflight's verdict (k8s/nccl_check.py) on nccl-tests runs, one per collective FSDP relies on: EFA on every
node, bus bandwidth above the collective's floor for the instance type, every run finished in time; a failure
names the collective, the node and the figure."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from infra.instances import instance_facts
from k8s import nccl_check
from k8s.charts.preflight import COLLECTIVES

SAMPLES = Path(__file__).parent / "nccl_samples"
P5 = instance_facts("p5.48xlarge")
NODES = "ip-10-0-64-11, ip-10-0-71-205"


def _verdict(sample: str, collective: str = "all_reduce", nodes: int = 2) -> list[str]:
    run = nccl_check.parse((SAMPLES / sample).read_text().splitlines())
    return nccl_check.failures(run, collective=collective, instance_type=P5.name,
                               min_busbw_gbs=P5.min_busbw_gbs(collective), nodes=nodes)


def _script(*args: str, floors: dict[str, float] | None = None, timeout_s: float = 60) -> subprocess.CompletedProcess:
    """As in the launcher pod: the file alone, standard library only, wrapping the command."""
    floors = floors if floors is not None else {c: P5.min_busbw_gbs(c) for c in COLLECTIVES}
    floor_args = [arg for c, floor in floors.items() for arg in ("--floor", f"{c}={floor:g}")]
    return subprocess.run([sys.executable, "-I", nccl_check.__file__, "--instance-type", P5.name, *floor_args,
                           "--nodes", "2", "--timeout-s", str(timeout_s), *args], capture_output=True, text=True,
                          timeout=120)


def test_floors_follow_the_efa_line_rate_and_busbw_definitions():
    assert [P5.min_busbw_gbs(c) for c in COLLECTIVES] == [300, 240, 240, 200]
    assert [instance_facts("p4d.24xlarge").min_busbw_gbs(c) for c in COLLECTIVES] == [37.5, 30, 30, 25]


@pytest.mark.parametrize(("collective", "busbw"), [("all_reduce", 372.20), ("all_gather", 331.2),
                                                   ("reduce_scatter", 335.8), ("broadcast", 312.6)])
def test_two_p5_nodes_on_efa_at_full_bandwidth_pass_every_collective(collective, busbw):
    run = nccl_check.parse((SAMPLES / f"efa_two_p5_{collective}.log").read_text().splitlines())
    assert run.hosts == run.efa_hosts == {"ip-10-0-64-11", "ip-10-0-71-205"}
    assert (run.largest_size, run.busbw_gbs) == (17179869184, busbw)
    assert _verdict(f"efa_two_p5_{collective}.log", collective) == []


def test_tcp_socket_fallback_fails_naming_the_collective_and_the_node():
    problems = _verdict("tcp_fallback_two_p5_all_reduce.log")
    assert ("all_reduce: node ip-10-0-71-205: NCCL did not use EFA, no NET/OFI transport line (NCCL used TCP sockets: "
            "NET/Socket)") in problems
    assert not [p for p in problems if "node ip-10-0-64-11" in p]


def test_failures_name_each_pods_kubernetes_node_where_known():
    run = nccl_check.parse((SAMPLES / "tcp_fallback_two_p5_all_reduce.log").read_text().splitlines())
    names = {"ip-10-0-71-205": "ip-10-0-71-205.ec2.internal"}
    assert ("all_reduce: node ip-10-0-71-205.ec2.internal (pod ip-10-0-71-205): NCCL did not use EFA, no NET/OFI "
            "transport line (NCCL used TCP sockets: NET/Socket)") in nccl_check.failures(
        run, collective="all_reduce", instance_type=P5.name, min_busbw_gbs=300, nodes=2, node_names=names)


def test_node_names_come_from_the_workers_lines_tags_and_all():
    lines = "[1,0]<stdout>:pod-w-0 ip-10-0-64-11.ec2.internal\n[1,1]<stdout>:pod-w-1 ip-10-0-71-205.ec2.internal\n"
    assert nccl_check.node_names(["printf", lines]) == {"pod-w-0": "ip-10-0-64-11.ec2.internal",
                                                         "pod-w-1": "ip-10-0-71-205.ec2.internal"}
    assert nccl_check.node_names(["no-such-command"]) == {}  # the verdict then names pods only


def test_low_all_reduce_bandwidth_fails_with_the_figure_and_the_floor():
    [problem] = _verdict("slow_efa_two_p5_all_reduce.log")
    assert problem == (f"all_reduce: bus bandwidth 224.3 GB/s at 17179869184 bytes across nodes {NODES} is below "
                       "300 GB/s for p5.48xlarge")


def test_a_slow_all_gather_fails_against_its_own_floor_though_it_would_pass_all_reduces():
    [problem] = _verdict("slow_efa_two_p5_all_gather.log", "all_gather")
    assert problem == (f"all_gather: bus bandwidth 151.3 GB/s at 17179869184 bytes across nodes {NODES} is below "
                       "240 GB/s for p5.48xlarge")


def test_a_run_on_fewer_nodes_than_the_job_fails():
    assert _verdict("efa_two_p5_all_reduce.log", nodes=3) == [
        f"all_reduce: 2 node(s) took part ({NODES}), expected 3"]


def test_output_without_results_or_with_wrong_values_fails():
    run = nccl_check.parse(["[1,0]<stdout>:#  Rank  0 Group  0 Pid 1 on ip-a device  0 [0x53] NVIDIA H100"])
    assert "broadcast: no broadcast_perf results in the output" in nccl_check.failures(
        run, collective="broadcast", instance_type=P5.name, min_busbw_gbs=200, nodes=1)
    wrong = (SAMPLES / "efa_two_p5_all_reduce.log").read_text().replace("372.20      0", "372.20      3")
    assert "all_reduce: 3 wrong value(s) in the all_reduce_perf results" in nccl_check.failures(
        nccl_check.parse(wrong.splitlines()), collective="all_reduce", instance_type=P5.name, min_busbw_gbs=300,
        nodes=2)


def test_the_script_runs_every_collective_in_order_and_passes_when_all_pass():
    proc = _script("--", "cat", str(SAMPLES / "efa_two_p5_{collective}.log"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    runs = [line for line in proc.stdout.splitlines() if line.startswith("PREFLIGHT RUNNING")]
    assert [line.split()[2] for line in runs] == list(COLLECTIVES)
    assert proc.stdout.count("# Avg bus bandwidth") == 4  # each run's own output comes through
    assert (f"PREFLIGHT PASSED: NET/OFI on {NODES}; bus bandwidth (GB/s) all_reduce 372.2 >= 300; all_gather 331.2 "
            ">= 240; reduce_scatter 335.8 >= 240; broadcast 312.6 >= 200 for p5.48xlarge") in proc.stdout


def test_the_script_fails_on_one_slow_collective_naming_it_and_the_nodes():
    samples = {c: f"efa_two_p5_{c}.log" for c in COLLECTIVES} | {"all_gather": "slow_efa_two_p5_all_gather.log"}
    script = " ; ".join(f'[ "$1" = {c} ] && cat {SAMPLES / f}' for c, f in samples.items()) + " ; true"
    proc = _script("--", "sh", "-c", script, "sh", "{collective}")
    assert proc.returncode == 1
    failed = [line for line in proc.stdout.splitlines() if line.startswith("PREFLIGHT FAILED")]
    assert failed == [f"PREFLIGHT FAILED: all_gather: bus bandwidth 151.3 GB/s at 17179869184 bytes across nodes "
                      f"{NODES} is below 240 GB/s for p5.48xlarge"]


def test_a_hung_collective_is_killed_at_its_timeout_reported_by_name_and_the_rest_still_run():
    hang = f"cat {SAMPLES / 'hung_efa_two_p5_broadcast.log'}; exec sleep 60"
    floors = {"broadcast": 200, "all_reduce": 300}
    start = time.monotonic()
    proc = _script("--", "sh", "-c", f'if [ "$1" = broadcast ]; then {hang}; else cat {SAMPLES}/efa_two_p5_$1.log; fi',
                   "sh", "{collective}", floors=floors, timeout_s=2)
    assert time.monotonic() - start < 30  # killed, not waited for
    assert proc.returncode == 1
    failed = [line for line in proc.stdout.splitlines() if line.startswith("PREFLIGHT FAILED")]
    assert failed == ["PREFLIGHT FAILED: broadcast: no result within 2 s, killed: a hang (e.g. aws-ofi-nccl 1.18.0 on "
                      "broadcast) or a fabric far below 200 GB/s"]
    assert "PREFLIGHT RUNNING: all_reduce" in proc.stdout  # the next collective ran


def test_the_script_names_the_node_from_its_node_names_command():
    names = "ip-10-0-71-205 ip-10-0-71-205.ec2.internal"
    proc = _script("--node-names", f"echo {names}", "--", "cat", str(SAMPLES / "tcp_fallback_two_p5_all_reduce.log"),
                   floors={"all_reduce": 300})
    assert proc.returncode == 1
    assert ("PREFLIGHT FAILED: all_reduce: node ip-10-0-71-205.ec2.internal (pod ip-10-0-71-205): NCCL did not use "
            "EFA") in proc.stdout


def test_a_failing_command_fails_the_preflight():
    proc = _script("--", "false", floors={"all_reduce": 300})
    assert proc.returncode == 1
    assert "PREFLIGHT FAILED: all_reduce: false exited with 1" in proc.stdout


def test_several_collectives_need_the_placeholder_in_the_command():
    proc = _script("--", "cat", str(SAMPLES / "efa_two_p5_all_reduce.log"))
    assert proc.returncode == 2
    assert "must name the collective as {collective}" in proc.stderr
    bad = _script("--", "true", floors={})
    assert bad.returncode == 2  # --floor is required
