"""The NCCL/EFA preflight's verdict on an nccl-tests `all_reduce_perf` run across the GPU nodes.

Runs inside the preflight MPIJob's launcher (standard library only: the chart ships this file in a
ConfigMap): `python3 nccl_check.py --instance-type p5.48xlarge --min-busbw-gbs 300 --nodes 2
[--node-names "mpirun … cat FILE"] -- mpirun …` streams the run's output and exits 1, naming the node and
the figure, when
- a node's NCCL did not log the EFA transport (`NET/OFI`, aws-ofi-nccl's lines at NCCL_DEBUG=INFO),
  e.g. it fell back to TCP sockets (`NET/Socket`, `Using network Socket`);
- the bus bandwidth at the largest message size is below the instance type's floor
  (infra/instances.py, min_allreduce_busbw_gbs);
- fewer nodes took part than the Job's size, the results had wrong values, or mpirun failed.
NCCL and nccl-tests name hosts by the pod's hostname; --node-names runs a command that prints
"<hostname> <node name>" per worker (each worker wrote its Kubernetes node name at start), so a failure
names the node to cordon, with its pod.
"""
from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Iterable, Mapping

# `mpirun --tag-output` prefixes every line with the job and rank: "[1,3]<stdout>:".
_TAG = re.compile(r"^\[\d+,\d+\]<std(?:out|err)>:\s?")
# NCCL's debug lines start "<hostname>:<pid>:<tid> [<device>] NCCL INFO …".
_NCCL_LINE = re.compile(r"^(?P<host>[\w.-]+):\d+:\d+ \[\d+\] NCCL (?:INFO|WARN) (?P<text>.*)$")
# nccl-tests' rank table: "#  Rank  0 Group  0 Pid   1234 on ip-10-0-0-1 device  0 [0x53] NVIDIA H100".
_RANK_LINE = re.compile(r"^#\s+Rank\s+\d+\s+Group\s+\d+\s+Pid\s+\d+\s+on\s+(?P<host>\S+)\s+device")
# A result row: size count type redop root, then time algbw busbw #wrong out of place, then in place.
_RESULT_ROW = re.compile(r"^\s*(?P<size>\d+)\s+\d+\s+\w+\s+\w+\s+-?\d+\s+(?P<out>(?:\S+\s+){3}\S+)\s+(?P<inp>(?:\S+\s*){4})$")


@dataclass
class NcclRun:
    """What the check reads from an all_reduce_perf run's output."""

    hosts: set[str] = field(default_factory=set)  # nodes that ran ranks
    efa_hosts: set[str] = field(default_factory=set)  # nodes whose NCCL logged NET/OFI
    socket_hosts: set[str] = field(default_factory=set)  # nodes whose NCCL used TCP sockets
    largest_size: int = 0  # bytes of the largest message size measured
    busbw_gbs: float | None = None  # bus bandwidth (GB/s) at that size, the better of out- and in-place
    wrong_values: int = 0


def parse(lines: Iterable[str]) -> NcclRun:
    run = NcclRun()
    for raw in lines:
        line = _TAG.sub("", raw.rstrip("\n"))
        if match := _RANK_LINE.match(line):
            run.hosts.add(match["host"])
        elif match := _NCCL_LINE.match(line):
            text = match["text"]
            if text.startswith("NET/OFI"):
                run.efa_hosts.add(match["host"])
            elif text.startswith("NET/Socket") or text.strip() == "Using network Socket":
                run.socket_hosts.add(match["host"])
        elif match := _RESULT_ROW.match(line):
            size = int(match["size"])
            out_place, in_place = match["out"].split(), match["inp"].split()
            busbw = max(float(out_place[2]), float(in_place[2]))
            run.wrong_values += sum(int(v) for v in (out_place[3], in_place[3]) if v.isdigit())
            if size >= run.largest_size:
                run.largest_size, run.busbw_gbs = size, busbw
    return run


def failures(run: NcclRun, *, instance_type: str, min_busbw_gbs: float, nodes: int,
             node_names: Mapping[str, str] | None = None) -> list[str]:
    """Why the run fails the preflight, one sentence each; empty when it passes. `node_names`: the
    Kubernetes node of each host (pod hostname), where known."""
    names = node_names or {}

    def hosts(among: Iterable[str]) -> str:
        return ", ".join(f"{names[h]} (pod {h})" if h in names else h for h in sorted(among)) or "none"

    problems = []
    if len(run.hosts) < nodes:
        problems.append(f"{len(run.hosts)} node(s) took part ({hosts(run.hosts)}), expected {nodes}")
    for host in sorted(run.hosts - run.efa_hosts):
        fallback = " (NCCL used TCP sockets: NET/Socket)" if host in run.socket_hosts else ""
        problems.append(f"node {hosts([host])}: NCCL did not use EFA, no NET/OFI transport line{fallback}")
    if run.busbw_gbs is None:
        problems.append("no all_reduce_perf results in the output")
    elif run.busbw_gbs < min_busbw_gbs:
        problems.append(f"bus bandwidth {run.busbw_gbs:.1f} GB/s at {run.largest_size} bytes across nodes "
                        f"{hosts(run.hosts)} is below {min_busbw_gbs:g} GB/s for {instance_type}")
    if run.wrong_values:
        problems.append(f"{run.wrong_values} wrong value(s) in the all_reduce_perf results")
    return problems


def node_names(command: list[str]) -> dict[str, str]:
    """hostname -> node name, from a command printing "<hostname> <node name>" lines (mpirun tags allowed);
    empty when it fails: the verdict then names pods only."""
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=300).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    pairs = (_TAG.sub("", line).split() for line in out.splitlines())
    return {pair[0]: pair[1] for pair in pairs if len(pair) == 2}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--instance-type", required=True)
    p.add_argument("--min-busbw-gbs", type=float, required=True)
    p.add_argument("--nodes", type=int, required=True, help="GPU nodes the run must span")
    p.add_argument("--node-names", metavar="COMMAND", help='one string: a command printing "<hostname> <node name>" '
                   "per worker, run first; failures then name each pod's node")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- mpirun … all_reduce_perf …")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("give the nccl-tests command after --")
    names = node_names(shlex.split(args.node_names)) if args.node_names else {}
    output: list[str] = []
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        for line in proc.stdout:  # streamed: `kubectl logs` shows the run as it goes
            sys.stdout.write(line)
            output.append(line)
    run = parse(output)
    problems = failures(run, instance_type=args.instance_type, min_busbw_gbs=args.min_busbw_gbs, nodes=args.nodes,
                        node_names=names)
    if proc.returncode:
        problems.insert(0, f"{command[0]} exited with {proc.returncode}")
    for problem in problems:
        print(f"PREFLIGHT FAILED: {problem}", flush=True)
    if not problems:
        print(f"PREFLIGHT PASSED: NET/OFI on {', '.join(sorted(run.hosts))}; bus bandwidth {run.busbw_gbs:.1f} GB/s "
              f">= {args.min_busbw_gbs:g} GB/s for {args.instance_type}", flush=True)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
