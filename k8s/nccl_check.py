"""The NCCL/EFA preflight's verdict on nccl-tests runs across the GPU nodes, one per collective.

It runs in the preflight MPIJob's launcher, on the standard library only (the chart ships it in a
ConfigMap). It runs the command once per `--floor` collective and exits 1, naming the collective, the
node and the figure, when EFA was not used, the bus bandwidth is below the floor, a run hung, or a node
was missing. FSDP2 moves its bytes with all-gather and reduce-scatter, so those are checked beside
all-reduce. Each verdict and its floor: docs/deploying.md.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
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
    """What the check reads from one nccl-tests run's output."""

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


PLACEHOLDER = "{collective}"


def failures(run: NcclRun, *, collective: str, instance_type: str, min_busbw_gbs: float, nodes: int,
             node_names: Mapping[str, str] | None = None, finished: bool = True) -> list[str]:
    """Why the run of `collective` fails the preflight, one sentence each; empty when it passes. `node_names`:
    the Kubernetes node of each host (pod hostname), where known. A run that did not finish is judged on its
    transport only: its bandwidth at a smaller size says nothing against the floor."""
    names = node_names or {}

    def hosts(among: Iterable[str]) -> str:
        return ", ".join(f"{names[h]} (pod {h})" if h in names else h for h in sorted(among)) or "none"

    problems = []
    if len(run.hosts) < nodes:
        problems.append(f"{len(run.hosts)} node(s) took part ({hosts(run.hosts)}), expected {nodes}")
    for host in sorted(run.hosts - run.efa_hosts):
        fallback = " (NCCL used TCP sockets: NET/Socket)" if host in run.socket_hosts else ""
        problems.append(f"node {hosts([host])}: NCCL did not use EFA, no NET/OFI transport line{fallback}")
    if finished:
        if run.busbw_gbs is None:
            problems.append(f"no {collective}_perf results in the output")
        elif run.busbw_gbs < min_busbw_gbs:
            problems.append(f"bus bandwidth {run.busbw_gbs:.1f} GB/s at {run.largest_size} bytes across nodes "
                            f"{hosts(run.hosts)} is below {min_busbw_gbs:g} GB/s for {instance_type}")
        if run.wrong_values:
            problems.append(f"{run.wrong_values} wrong value(s) in the {collective}_perf results")
    return [f"{collective}: {problem}" for problem in problems]


def node_names(command: list[str]) -> dict[str, str]:
    """hostname -> node name, from a command printing "<hostname> <node name>" lines (mpirun tags allowed);
    empty when it fails: the verdict then names pods only."""
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=300).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    pairs = (_TAG.sub("", line).split() for line in out.splitlines())
    return {pair[0]: pair[1] for pair in pairs if len(pair) == 2}


def run_bounded(command: list[str], timeout_s: float) -> tuple[list[str], int, bool]:
    """Run `command`, streaming its output (`kubectl logs` shows the run as it goes); kill its whole process
    group after `timeout_s`. Returns (output lines, exit code, whether it was killed for taking too long)."""
    output: list[str] = []
    timed_out = threading.Event()
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          start_new_session=True) as proc:
        def kill() -> None:
            timed_out.set()
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

        timer = threading.Timer(timeout_s, kill)
        timer.start()
        try:
            for line in proc.stdout:
                sys.stdout.write(line)
                output.append(line)
            proc.wait()
        finally:
            timer.cancel()
    return output, proc.returncode, timed_out.is_set()


def _floor(text: str) -> tuple[str, float]:
    name, sep, value = text.partition("=")
    try:
        if sep and re.fullmatch(r"[a-z_]+", name):
            return name, float(value)
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"--floor {text!r}: expected COLLECTIVE=GB/s, e.g. all_gather=240")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--instance-type", required=True)
    p.add_argument("--floor", type=_floor, action="append", required=True, metavar="COLLECTIVE=GBS",
                   help="a collective to run and its bus bandwidth floor (GB/s); repeat, run in order")
    p.add_argument("--nodes", type=int, required=True, help="GPU nodes the run must span")
    p.add_argument("--timeout-s", type=float, required=True, help="longest one collective's run may take")
    p.add_argument("--node-names", metavar="COMMAND", help='one string: a command printing "<hostname> <node name>" '
                   "per worker, run first; failures then name each pod's node")
    p.add_argument("command", nargs=argparse.REMAINDER, help=f"-- mpirun … {PLACEHOLDER}_perf …")
    args = p.parse_args(argv)
    template = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not template:
        p.error("give the nccl-tests command after --")
    if len(args.floor) > 1 and not any(PLACEHOLDER in arg for arg in template):
        p.error(f"the command must name the collective as {PLACEHOLDER} when more than one --floor is given")
    names = node_names(shlex.split(args.node_names)) if args.node_names else {}
    problems: list[str] = []
    passed: list[str] = []
    hosts: set[str] = set()
    for collective, floor in args.floor:
        command = [arg.replace(PLACEHOLDER, collective) for arg in template]
        print(f"PREFLIGHT RUNNING: {collective} ({shlex.join(command)})", flush=True)
        output, returncode, timed_out = run_bounded(command, args.timeout_s)
        run = parse(output)
        hosts |= run.hosts
        found = failures(run, collective=collective, instance_type=args.instance_type, min_busbw_gbs=floor,
                         nodes=args.nodes, node_names=names, finished=not timed_out)
        if timed_out:
            found.insert(0, f"{collective}: no result within {args.timeout_s:g} s, killed: a hang (e.g. aws-ofi-nccl "
                            f"1.18.0 on broadcast) or a fabric far below {floor:g} GB/s")
        elif returncode:
            found.insert(0, f"{collective}: {command[0]} exited with {returncode}")
        problems += found
        if not found:
            passed.append(f"{collective} {run.busbw_gbs:.1f} >= {floor:g}")
    for problem in problems:
        print(f"PREFLIGHT FAILED: {problem}", flush=True)
    if not problems:
        print(f"PREFLIGHT PASSED: NET/OFI on {', '.join(sorted(hosts))}; bus bandwidth (GB/s) {'; '.join(passed)} "
              f"for {args.instance_type}", flush=True)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
