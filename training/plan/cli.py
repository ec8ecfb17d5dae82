"""`python -m training.plan`: the planner's command line (`planner`), with or without the capacity model."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Sequence

from training.contract.capacity import (P5_48XLARGE, Capacity, FsxSpec, ModelFootprint, Schedule, capacity_of,
                                        format_capacity)
from training.contract.config import TrainConfigError, load_train_config
from training.contract.model_source import ModelSourceError
from training.plan import planner
from training.plan.capacity_tables import capacity_tables
from training.plan.planner import (BENCH_REPLICA_GROUPS, LLAMA3_NODE_FAILURE_RATE, REPLICA_GROUPS, Mechanism, PlanError,
                                   format_plan, format_scale, from_bench, make_plan, mechanism_arg, positive_float_arg,
                                   positive_int_arg, with_replica_groups)


def fsx_from_cdk_json(path: Path, storage_gib: int | None, throughput_per_tib: int | None) -> FsxSpec:
    """The FSx the platform provisions (cdk.json's context), each value unless given."""
    if storage_gib is None or throughput_per_tib is None:
        try:
            context = json.loads(path.read_text())["context"]
            storage_gib = storage_gib or context["fsxStorageGib"]
            throughput_per_tib = throughput_per_tib or context["fsxThroughputPerTib"]
        except (OSError, ValueError, KeyError) as err:
            raise PlanError(f"{path}: cannot read fsxStorageGib and fsxThroughputPerTib ({err}); give "
                            "--fsx-storage-gib and --fsx-throughput-per-tib") from None
    try:
        return FsxSpec(int(storage_gib), int(throughput_per_tib))
    except ValueError as err:
        raise PlanError(f"FSx: {err}") from None


def capacity_mechanisms(c: Capacity) -> tuple[Mechanism, ...]:
    """A lost node's recovery per mechanism, from the capacity model: from FSx, and from peers when on."""
    fsx = Mechanism("injob", c.recovery_fsx_s)
    return (fsx, Mechanism("peer_state", c.recovery_peer_s)) if c.schedule.peer_state else (fsx,)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.plan", description=planner.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=positive_int_arg)
    parser.add_argument("--gpus-per-node", type=positive_int_arg, default=8)
    parser.add_argument("--node-mtbf-hours", type=positive_float_arg, default=1 / LLAMA3_NODE_FAILURE_RATE,
                        help="mean time between failures of one node (default: the Llama 3 rate, %(default).0f h)")
    parser.add_argument("--save-blocking-s", type=positive_float_arg, help="S: seconds one save blocks training")
    parser.add_argument("--recovery-s", type=mechanism_arg, action="append", metavar="[NAME=]SECONDS",
                        help="R of a recovery mechanism; repeat for several (inprocess, peer_state: resume "
                             "from memory)")
    parser.add_argument("--replica-groups", type=positive_int_arg, metavar="R",
                        help=f"plan the {REPLICA_GROUPS} mechanism with R groups (default: the bench's "
                             f"{BENCH_REPLICA_GROUPS}): a failure stops only its group, the others stall")
    parser.add_argument("--survivor-stall-s", type=positive_float_arg,
                        help=f"the other groups' stall per failure, for --recovery-s {REPLICA_GROUPS}=SECONDS "
                             "(default: the bench result's median_survivor_stall_s)")
    parser.add_argument("--commit-lag-s", type=positive_float_arg,
                        help="D: seconds a checkpoint stays uncommitted after its save stopped blocking, an async "
                             "save's write (default: the capacity model's with --config, else 0: saves commit when "
                             "they stop blocking, as sync saves do)")
    parser.add_argument("--step-s", type=positive_float_arg,
                        help="training step time, one optimizer step with every micro-batch of its global batch: "
                             "the work in-process recovery loses (default: the capacity model's with --config, "
                             "else 1.0)")
    parser.add_argument("--from-bench", type=Path, metavar="FILE", help="take S and R from a bench result")
    parser.add_argument("--save-mode", choices=("async", "sync"), default="async",
                        help="which blocking time of --from-bench to use (default async)")
    parser.add_argument("--config", type=Path, metavar="FILE",
                        help="a training config on --nodes p5.48xlarge nodes: S, the step time and R from the "
                             "capacity model")
    parser.add_argument("--cdk-json", type=Path, default=Path("cdk.json"),
                        help="where --config reads the provisioned FSx (default: %(default)s)")
    parser.add_argument("--fsx-storage-gib", type=positive_int_arg, help="FSx storage (default: cdk.json's)")
    parser.add_argument("--fsx-throughput-per-tib", type=positive_int_arg, help="FSx MBps/TiB (default: cdk.json's)")
    parser.add_argument("--capacity-tables", action="store_true",
                        help="print the tables of docs/capacity.md (8b and 70b on 2, 32, 256 p5 nodes) and exit")
    args = parser.parse_args(argv)
    if args.capacity_tables:
        print(capacity_tables())
        return 0
    if args.nodes is None:
        parser.error("the following arguments are required: --nodes")
    save, mechanisms, step_s, commit_lag_s = args.save_blocking_s, args.recovery_s, args.step_s, args.commit_lag_s
    try:
        if args.config:
            if args.gpus_per_node != P5_48XLARGE.gpus:
                raise PlanError(f"--gpus-per-node {args.gpus_per_node} does not go with --config: the capacity "
                                f"model sizes {P5_48XLARGE.name} nodes ({P5_48XLARGE.gpus} GPUs each)")
            train = load_train_config(args.config)
            fsx = fsx_from_cdk_json(args.cdk_json, args.fsx_storage_gib, args.fsx_throughput_per_tib)
            capacity = capacity_of(ModelFootprint.from_config(train), P5_48XLARGE, args.nodes, fsx,
                                   Schedule.from_config(train, args.nodes * P5_48XLARGE.gpus), step_s)
            print(format_capacity(capacity))
            save, step_s = save or capacity.blocking_s, capacity.step_s
            mechanisms = mechanisms or list(capacity_mechanisms(capacity))
            commit_lag_s = commit_lag_s or capacity.commit_lag_s
        if args.from_bench and (save is None or not mechanisms):
            bench_save, bench_mechanisms = from_bench(args.from_bench, args.save_mode)
            save, mechanisms = save or bench_save, mechanisms or bench_mechanisms
        if save is None or not mechanisms:
            parser.error("give --save-blocking-s and --recovery-s, --from-bench FILE or --config FILE")
        mechanisms = with_replica_groups(mechanisms, args.replica_groups, args.survivor_stall_s)
    except (PlanError, TrainConfigError, ModelSourceError) as err:  # a Hugging Face model's config.json unread
        parser.exit(2, f"error: {err}\n")
    names = [m.name for m in mechanisms]
    if len(set(names)) < len(names):
        parser.error(f"--recovery-s: each mechanism once, got {names}")
    step_s, commit_lag_s = step_s or 1.0, commit_lag_s or 0.0
    print(format_plan(make_plan(args.nodes, args.gpus_per_node, args.node_mtbf_hours, save, step_s,
                                mechanisms, commit_lag_s)))
    print(format_scale(save, step_s, mechanisms, commit_lag_s))
    return 0
