"""A local cluster's shape: its nodes, ranks per node, hot spares, replica groups and emulated machines, and
how the Job treats a lost node (its replacement's delay, the retries of a failed one). One value: read from
`python -m training.local`'s flags (training.local.cli), written back as those flags (`argv`, what the bench
and the tests start a cluster with), and what each Job's controller (training.local.cluster.Cluster) runs.
"""
from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class ClusterShape:
    """Args:
        nodes: training nodes, of every replica group together (the world size is nodes x nproc_per_node)
        nproc_per_node: ranks per node
        spares: hot spare nodes, of each replica group
        replacement_delay_s: from a node's loss to its replacement's start (Kubernetes' part of a replacement)
        node_retries: replacements per node after its launcher failed (the Job's backoffLimitPerIndex)
        replica_groups: R groups of nodes // R nodes each (parallel.replica_groups); None: the config's
        netns: each node on its own emulated machine (training.local.netns)
    """
    nodes: int = 2
    nproc_per_node: int = 2
    spares: int = 0
    replacement_delay_s: float = 0.0
    node_retries: int = 3
    replica_groups: int | None = None
    netns: bool = False

    def argv(self) -> tuple[str, ...]:
        """The flags of `python -m training.local` that give this shape."""
        return ("--nodes", str(self.nodes), "--nproc-per-node", str(self.nproc_per_node),
                "--spares", str(self.spares), "--replacement-delay", f"{self.replacement_delay_s:g}",
                "--node-retries", str(self.node_retries),
                *(("--replica-groups", str(self.replica_groups)) if self.replica_groups is not None else ()),
                *(("--netns",) if self.netns else ()))

    def of_group(self, groups: int) -> ClusterShape:
        """One of `groups` replica groups' Job: its share of the nodes, and the spares of each group."""
        return replace(self, nodes=self.nodes // groups, replica_groups=1)
