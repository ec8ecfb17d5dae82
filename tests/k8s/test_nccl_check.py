"""The preflight's verdict (k8s/nccl_check.py) on nccl-tests all_reduce_perf output: EFA on every node,
bus bandwidth above the instance type's floor, a failure naming the node and the figure."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from infra.instances import instance_facts
from k8s import nccl_check

SAMPLES = Path(__file__).parent / "nccl_samples"
P5 = instance_facts("p5.48xlarge")


def _verdict(sample: str, nodes: int = 2) -> list[str]:
    run = nccl_check.parse((SAMPLES / sample).read_text().splitlines())
    return nccl_check.failures(run, instance_type=P5.name, min_busbw_gbs=P5.min_allreduce_busbw_gbs, nodes=nodes)


def test_two_p5_nodes_on_efa_at_full_bandwidth_pass():
    run = nccl_check.parse((SAMPLES / "efa_two_p5.log").read_text().splitlines())
    assert run.hosts == run.efa_hosts == {"ip-10-0-64-11", "ip-10-0-71-205"}
    assert (run.largest_size, run.busbw_gbs) == (17179869184, 372.20)
    assert _verdict("efa_two_p5.log") == []


def test_tcp_socket_fallback_fails_naming_the_node():
    problems = _verdict("tcp_fallback_two_p5.log")
    assert "node ip-10-0-71-205: NCCL did not use EFA, no NET/OFI transport line (NCCL used TCP sockets: NET/Socket)" \
        in problems
    assert not [p for p in problems if "ip-10-0-64-11:" in p or p.startswith("node ip-10-0-64-11")]


def test_failures_name_each_pods_kubernetes_node_where_known():
    run = nccl_check.parse((SAMPLES / "tcp_fallback_two_p5.log").read_text().splitlines())
    names = {"ip-10-0-71-205": "ip-10-0-71-205.ec2.internal"}
    assert ("node ip-10-0-71-205.ec2.internal (pod ip-10-0-71-205): NCCL did not use EFA, no NET/OFI transport line "
            "(NCCL used TCP sockets: NET/Socket)") in nccl_check.failures(
        run, instance_type=P5.name, min_busbw_gbs=300, nodes=2, node_names=names)


def test_node_names_come_from_the_workers_lines_tags_and_all():
    lines = "[1,0]<stdout>:pod-w-0 ip-10-0-64-11.ec2.internal\n[1,1]<stdout>:pod-w-1 ip-10-0-71-205.ec2.internal\n"
    assert nccl_check.node_names(["printf", lines]) == {"pod-w-0": "ip-10-0-64-11.ec2.internal",
                                                         "pod-w-1": "ip-10-0-71-205.ec2.internal"}
    assert nccl_check.node_names(["no-such-command"]) == {}  # the verdict then names pods only


def test_low_bus_bandwidth_fails_with_the_figure_and_the_floor():
    [problem] = _verdict("slow_efa_two_p5.log")
    assert "bus bandwidth 224.3 GB/s at 17179869184 bytes" in problem
    assert "ip-10-0-64-11, ip-10-0-71-205" in problem
    assert "below 300 GB/s for p5.48xlarge" in problem


def test_a_run_on_fewer_nodes_than_the_job_fails():
    assert _verdict("efa_two_p5.log", nodes=3) == ["2 node(s) took part (ip-10-0-64-11, ip-10-0-71-205), expected 3"]


def test_output_without_results_or_with_wrong_values_fails():
    run = nccl_check.parse(["[1,0]<stdout>:#  Rank  0 Group  0 Pid 1 on ip-a device  0 [0x53] NVIDIA H100"])
    assert "no all_reduce_perf results in the output" in nccl_check.failures(
        run, instance_type=P5.name, min_busbw_gbs=300, nodes=1)
    wrong = (SAMPLES / "efa_two_p5.log").read_text().replace("372.20      0", "372.20      3")
    assert "3 wrong value(s)" in " ".join(nccl_check.failures(
        nccl_check.parse(wrong.splitlines()), instance_type=P5.name, min_busbw_gbs=300, nodes=2))


@pytest.mark.parametrize(("sample", "rc", "verdict"), [
    ("efa_two_p5.log", 0, "PREFLIGHT PASSED: NET/OFI on ip-10-0-64-11, ip-10-0-71-205; bus bandwidth 372.2 GB/s"),
    ("tcp_fallback_two_p5.log", 1, "PREFLIGHT FAILED: node ip-10-0-71-205: NCCL did not use EFA"),
])
def test_the_script_runs_the_command_streams_its_output_and_exits_with_the_verdict(sample, rc, verdict):
    """As in the launcher pod: the file alone, standard library only, wrapping the command."""
    proc = subprocess.run([sys.executable, "-I", nccl_check.__file__, "--instance-type", P5.name,
                           "--min-busbw-gbs", str(P5.min_allreduce_busbw_gbs), "--nodes", "2",
                           "--", "cat", str(SAMPLES / sample)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == rc, proc.stdout + proc.stderr
    assert "# Avg bus bandwidth" in proc.stdout  # the run's own output comes through
    assert verdict in proc.stdout


def test_the_script_names_the_node_from_its_node_names_command():
    names = "ip-10-0-71-205 ip-10-0-71-205.ec2.internal"
    proc = subprocess.run([sys.executable, "-I", nccl_check.__file__, "--instance-type", P5.name,
                           "--min-busbw-gbs", "300", "--nodes", "2", "--node-names", f"echo {names}",
                           "--", "cat", str(SAMPLES / "tcp_fallback_two_p5.log")], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 1
    assert "PREFLIGHT FAILED: node ip-10-0-71-205.ec2.internal (pod ip-10-0-71-205): NCCL did not use EFA" in proc.stdout


def test_a_failing_command_fails_the_preflight():
    proc = subprocess.run([sys.executable, "-I", nccl_check.__file__, "--instance-type", P5.name,
                           "--min-busbw-gbs", "300", "--nodes", "2", "--", "false"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "PREFLIGHT FAILED: false exited with 1" in proc.stdout
