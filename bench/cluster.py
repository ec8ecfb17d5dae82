"""One run of the local emulated cluster (training.local's controller), driven from this process."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from training.local.cli import build_clusters, build_config, parse_args, run_clusters
from training.local.netns import VirtualNetwork
from training.local.shape import ClusterShape


@dataclass(frozen=True)
class ClusterSpec:
    run_dir: Path
    shape: ClusterShape
    steps: int
    overrides: tuple[str, ...]  # section.key=value; fault_tolerance.max_restarts sets ft_launcher's budget
    faults: tuple[str, ...] = ()  # training.train.faults specs


def run_cluster(spec: ClusterSpec) -> int:
    """Run to completion; returns the controller's status (0: every node, of every replica group, finished)."""
    args = parse_args([*spec.shape.argv(), "--steps", str(spec.steps), "--run-dir", str(spec.run_dir),
                       "--faults", ",".join(spec.faults), *spec.overrides])
    cfg, config_path = build_config(args)
    network = VirtualNetwork() if spec.shape.netns else None
    try:
        return run_clusters(*build_clusters(cfg, config_path, args, network))
    finally:
        if network is not None:
            network.close()
