"""`python -m training.local`: the command line of the local emulated cluster (training.local.cluster). It
reads the flags and the training config, refuses what cannot run before anything starts, builds the Job's
controller (one per replica group, under one Lighthouse) and prints the goodput report at the end.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from training.contract.config import (ConfigArgumentParser, ModelConfig, TrainConfig, TrainConfigError, config_or_exit,
                                      load_train_config)
from training.contract.exit_codes import CONFIG_ERROR
from training.contract.faults import FaultSpecError, parse_faults, with_env_faults
from training.contract.launcher import REJOIN_POLLS_S, SAVE_DELAY_ENV, free_port
from training.contract.model_source import ModelSourceError, check_model_source
from training.contract.replica_groups import check_torchft, lighthouse_command
from training.contract.shapes import ModelShape
from training.data.token_file import DataError, check_token_file
from training.local.cluster import BIN_DIR, REPO_ROOT, WORKERS_STOP_TIMEOUT_S, Cluster
from training.local.cluster import __doc__ as CLUSTER_DOC
from training.local.netns import NetworkUnavailable, VirtualNetwork
from training.local.replica_groups import Lighthouse, LighthouseError, run_groups, stall_summary
from training.local.shape import ClusterShape
from training.report.cli import write_report
from training.report.goodput import ReportError

# The demo shows recovery at its best: a crashed rank, a lost node (the hot spare takes its place) and a
# killed rank, each resumed at the step it reached from peer state, while the newest checkpoint is 19 steps back.
DEMO_STEPS = 160
DEMO_FAULTS = ("exception@40:rank=1", "node-loss@80:node=1", "sigkill@120:rank=3")
DEMO_SPARES = 1
# Later than a survivor is back in the restart round, so the round's last call stays NVRx's 1 s, as on EKS where
# a replacement takes minutes (training.contract.launcher.rendezvous_last_call_s)
DEMO_REPLACEMENT_DELAY_S = float(WORKERS_STOP_TIMEOUT_S + REJOIN_POLLS_S + 2)
# The demo: tiny model, async checkpoints every 20 steps, short gloo timeouts (a CPU collective
# cannot be aborted; a short timeout bounds how long survivors of a fault can hang).
# Hang timeouts are calculated as max observed x 10: room for a busy laptop. Peer state copies every
# step: the measured interval may let a busy laptop lose a step or more to a fault.
DEMO_OVERRIDES = ("model.preset=tiny", "checkpoint.mode=async", "checkpoint.interval=20",
                  "training.collective_timeout_s=30", "logging.log_interval=20",
                  "fault_tolerance.timeout_safety_factor=10", "peer_state.enabled=true", "peer_state.interval=1")


def check_model(model: ModelConfig) -> ModelShape:
    """The model's refusals before any rank starts and anything is written: its JSON files here, its weights
    in a child process (they need torch and transformers, which the controller does not import)."""
    shape = check_model_source(model)
    if model.source == "huggingface":
        check = subprocess.run([sys.executable, "-m", "training.models", "check", model.path], cwd=REPO_ROOT,
                               capture_output=True, text=True)
        if check.returncode:
            raise ModelSourceError(check.stderr.strip() or f"python -m training.models check {model.path} failed")
    return shape


def build_config(args: argparse.Namespace) -> tuple[TrainConfig, Path]:
    overrides = list(DEMO_OVERRIDES if args.demo else ()) + list(args.overrides)
    overrides.append(f"run_dir={args.run_dir}")
    if args.steps is not None:
        overrides.append(f"training.steps={args.steps}")
    if args.max_restarts is not None:
        overrides.append(f"fault_tolerance.max_restarts={args.max_restarts}")
    shape: ClusterShape = args.shape
    if shape.replica_groups is not None:
        overrides.append(f"parallel.replica_groups={shape.replica_groups}")
    if args.faults is not None:
        specs = [spec.strip() for group in args.faults for spec in group.split(",") if spec.strip()]
        overrides.append("faults=[" + ",".join(specs) + "]")
    cfg = with_env_faults(load_train_config(args.config, overrides))
    groups = cfg.parallel.replica_groups
    if shape.nodes % groups:
        allowed = [r for r in range(1, shape.nodes + 1) if shape.nodes % r == 0]
        raise TrainConfigError(f"--replica-groups={groups} does not divide --nodes={shape.nodes}: each group has as "
                               f"many whole nodes; allowed: {allowed}")
    if groups > 1 and (missing := check_torchft()):
        raise TrainConfigError(missing)
    group = shape.of_group(groups)
    group_world_size = group.nodes * group.nproc_per_node
    cfg.rows_per_step(group_world_size)  # a shape that cannot reach global_batch_size starts nothing
    specs = parse_faults(cfg.faults, world_size=group_world_size, nodes=group.nodes + group.spares, groups=groups)
    if not shape.netns and any(spec.kind == "partition" for spec in specs):
        raise FaultSpecError("partition faults need --netns: only nodes with a network of their own can be cut off")
    check_token_file(cfg.data.path, cfg.data.dtype, check_model(cfg.model).vocab_size)
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "config.yaml"
    path.write_text(cfg.to_yaml())
    return cfg, path


def write_group_config(cfg: TrainConfig, group: int) -> tuple[TrainConfig, Path]:
    """Group `group`'s config, written to its own run directory."""
    group_cfg = cfg.for_group(group)
    path = Path(group_cfg.run_dir) / "config.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(group_cfg.to_yaml())
    return group_cfg, path


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = ConfigArgumentParser(prog="python -m training.local", description=CLUSTER_DOC.split("\n\n")[0])
    p.add_argument("--demo", action="store_true", help=f"2 nodes x 2 ranks and {DEMO_SPARES} hot spare, tiny model, "
                   f"async checkpoints, peer state, {DEMO_STEPS} steps, injected faults ({', '.join(DEMO_FAULTS)})")
    p.add_argument("--nodes", type=int, default=2, help="training nodes (the world size is nodes x nproc-per-node), "
                   "of every replica group together")
    p.add_argument("--replica-groups", type=int, default=None, metavar="R",
                   help="R replica groups (parallel.replica_groups; torchft, docs/replica-groups.md): R must divide "
                   "--nodes; each group its own Job, store and spares, under one Lighthouse process")
    p.add_argument("--spares", type=int, default=None, help="hot spare nodes (of each replica group): they wait as "
                   "standby and take a failed node's place in the next rendezvous round "
                   f"(default 0; demo: {DEMO_SPARES})")
    p.add_argument("--replacement-delay", type=float, default=None, metavar="SECONDS",
                   help="from a node's loss to its replacement's start: Kubernetes' part of a node replacement "
                   f"(default 0; demo: {DEMO_REPLACEMENT_DELAY_S:g}; bench.projection has EKS's)")
    p.add_argument("--save-delay", type=float, default=0.0, metavar="SECONDS",
                   help="each rank's checkpoint write is held back this long: a checkpoint file system as slow as "
                        "FSx is at the size we ship (a save of 8b state takes minutes there)")
    p.add_argument("--netns", action="store_true", help="each node on its own emulated machine: a network "
                   "namespace with its own address and hostname (needs root and iproute2); partition faults need it")
    p.add_argument("--nproc-per-node", type=int, default=2)
    p.add_argument("--steps", type=int, default=None,
                   help=f"training.steps (default: the config's; demo: {DEMO_STEPS})")
    p.add_argument("--run-dir", default=None, help="default: runs/local-<time>")
    p.add_argument("--config", default=None, help="training config file (YAML/JSON)")
    p.add_argument("--faults", action="append", default=None, metavar="SPEC[,SPEC…]",
                   help="fault specs, comma-separated or repeated (format: docs/faults.md); "
                   "--faults '' runs the demo without faults")
    p.add_argument("--max-restarts", type=int, default=None, help="ft_launcher in-job restarts: "
                   "sets fault_tolerance.max_restarts")
    p.add_argument("--node-retries", type=int, default=3, help="replacements per node after its launcher failed (the "
                   "Job's backoffLimitPerIndex); a lost node (its launcher killed) and a drain do not count")
    p.add_argument("overrides", nargs="*", metavar="section.key=value")
    args = p.parse_args(argv)
    if args.demo:
        args.steps = args.steps or DEMO_STEPS
        if args.faults is None:
            args.faults = list(DEMO_FAULTS)
    if args.spares is None:
        args.spares = DEMO_SPARES if args.demo else 0
    if args.replacement_delay is None:
        args.replacement_delay = DEMO_REPLACEMENT_DELAY_S if args.demo else 0.0
    if args.nodes < 1 or args.nproc_per_node < 1 or (args.replica_groups is not None and args.replica_groups < 1):
        p.error("--nodes, --nproc-per-node and --replica-groups must be at least 1")
    if args.spares < 0 or args.replacement_delay < 0 or args.save_delay < 0:
        p.error("--spares, --replacement-delay and --save-delay must be 0 or more")
    args.run_dir = args.run_dir or f"runs/{'demo' if args.demo else 'local'}-{time.strftime('%Y%m%d-%H%M%S')}"
    args.shape = ClusterShape(args.nodes, args.nproc_per_node, args.spares, args.replacement_delay, args.node_retries,
                              args.replica_groups, args.netns)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg, config_path = config_or_exit("training.local", lambda: build_config(args),
                                      FaultSpecError, DataError, ModelSourceError)
    shape: ClusterShape = args.shape
    try:
        network = VirtualNetwork() if shape.netns else None
    except NetworkUnavailable as err:
        print(f"training.local: --netns: {err}", file=sys.stderr)
        return CONFIG_ERROR
    if args.save_delay:
        os.environ[SAVE_DELAY_ENV] = str(args.save_delay)  # every rank's environment (Cluster.env)
    groups = cfg.parallel.replica_groups
    clusters, lighthouse = build_clusters(cfg, config_path, args, network)
    _stop_on_signals(clusters)
    if lighthouse is None:
        nodes, where = f"{shape.nodes} node(s)", f"run directory {cfg.run_dir}; logs in {cfg.run_dir}/logs/"
    else:
        nodes = f"{groups} replica groups of {shape.of_group(groups).nodes} node(s)"
        where = f"run directories {cfg.run_dir}/group<g>, logs in their logs/; the Lighthouse's log {lighthouse.log_path}"
    spares = f" + {shape.spares} spare(s){' each' if groups > 1 else ''}" if shape.spares else ""
    clusters[0].say(f"{nodes}{spares} x {shape.nproc_per_node} rank(s), {cfg.training.steps} steps, checkpoints "
                    f"{cfg.checkpoint.mode}, faults: {', '.join(cfg.faults) or 'none'}; {where}")
    started = time.monotonic()
    try:
        status = run_clusters(clusters, lighthouse)
    except LighthouseError as err:
        print(f"training.local: {err}", file=sys.stderr)
        return 1
    finally:
        if network is not None:
            network.close()
    clusters[0].say(f"finished in {time.monotonic() - started:.1f} s; goodput report:")
    for cluster in clusters:
        try:
            print(write_report(cluster.run_dir, plot=True), flush=True)
        except ReportError as err:  # e.g. stopped before the first step: nothing to report
            print(f"no goodput report for {cluster.run_dir}: {err}", file=sys.stderr)
    if groups > 1:
        for line in stall_summary(Path(cfg.run_dir), groups):
            clusters[0].say(line)
    for cluster in clusters:
        if cluster.failure is not None:  # the last line says why, below the report
            cluster.say(f"the job failed: {cluster.failure}")
    return status


def build_clusters(cfg: TrainConfig, config_path: Path, args: argparse.Namespace,
                   network: VirtualNetwork | None) -> tuple[list[Cluster], Lighthouse | None]:
    """The Job's controller, or with replica groups one per group and the Lighthouse they share."""
    groups = cfg.parallel.replica_groups
    if groups == 1:
        return [Cluster(cfg, config_path, args.shape, network)], None
    port = free_port()
    command = lighthouse_command(cfg.parallel.lighthouse_options(), port, str(BIN_DIR))
    lighthouse = Lighthouse(command, port, Path(cfg.run_dir) / "lighthouse.log")
    address = f"http://{network.host_address if network else '127.0.0.1'}:{port}"
    return [Cluster(*write_group_config(cfg, g), args.shape.of_group(groups), network, replica_group=g,
                    lighthouse=address) for g in range(groups)], lighthouse


def run_clusters(clusters: list[Cluster], lighthouse: Lighthouse | None) -> int:
    """To the end: 0 when every node (of every group) finished, 1 on failure, 130 when stopped."""
    return clusters[0].run() if lighthouse is None else run_groups(clusters, lighthouse)


def _stop_on_signals(clusters: list[Cluster]) -> None:
    """Ctrl-C or SIGTERM stops every group's nodes, as the kubelet stops a pod."""
    def request_stop(signum: int, frame: object) -> None:
        for cluster in clusters:
            cluster.request_stop(signum, frame)

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
