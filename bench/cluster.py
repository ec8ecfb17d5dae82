"""One run of the local emulated cluster (training.local's controller), driven from this process."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from training.local.cli import build_clusters, build_config, parse_args, run_clusters
from training.local.netns import VirtualNetwork


@dataclass(frozen=True)
class ClusterSpec:
    run_dir: Path
    nodes: int
    nproc_per_node: int
    steps: int
    overrides: tuple[str, ...]  # section.key=value; fault_tolerance.max_restarts sets ft_launcher's budget
    faults: tuple[str, ...] = ()  # training.train.faults specs
    node_retries: int = 0  # replacements per node after its launcher was killed
    spares: int = 0  # hot spare nodes
    replacement_delay_s: float = 0.0  # a lost node's replacement starts this much later
    netns: bool = False  # each node on its own emulated machine (training.local.netns)
    replica_groups: int = 1  # groups of nodes / replica_groups nodes each, under one Lighthouse


def run_cluster(spec: ClusterSpec) -> int:
    """Run to completion; returns the controller's status (0: every node, of every replica group, finished)."""
    args = parse_args(["--nodes", str(spec.nodes), "--nproc-per-node", str(spec.nproc_per_node),
                       "--steps", str(spec.steps), "--run-dir", str(spec.run_dir), "--faults", ",".join(spec.faults),
                       "--node-retries", str(spec.node_retries), "--spares", str(spec.spares),
                       "--replacement-delay", str(spec.replacement_delay_s),
                       "--replica-groups", str(spec.replica_groups), *(["--netns"] if spec.netns else []),
                       *spec.overrides])
    cfg, config_path = build_config(args)
    network = VirtualNetwork() if spec.netns else None
    try:
        return run_clusters(*build_clusters(cfg, config_path, args, network))
    finally:
        if network is not None:
            network.close()
