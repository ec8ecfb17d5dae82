"""`make manifests`: render dist/*.k8s.yaml for `kubectl apply -f dist/`.

Inputs: the platform config (cdk.json "context" plus `-c key=value`, read by the same
PlatformConfig.from_context as the CDK app), the training config (k8s/train.yaml plus
`--set section.key=value`), and cdk-outputs.json from `cdk deploy --outputs-file` when present.
`--report` renders instead the Job that reports the configured run from FSx (k8s.charts.report).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import fields
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # `python k8s/main.py` puts k8s/, not the repository, on sys.path
    sys.path.insert(0, str(REPO_ROOT))
# The jsii runtime under cdk8s prints a Node 20 end-of-life banner on every start: known noise.
os.environ.setdefault("JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION", "20")

import cdk8s  # noqa: E402  (needs the environment above)

from infra.config import ConfigError, PlatformConfig  # noqa: E402
from k8s.charts.fault_injection import FaultInjectionChart  # noqa: E402
from k8s.charts.hung_nodes import HungNodeChart  # noqa: E402
from k8s.charts.network import NetworkDefaultsChart  # noqa: E402
from k8s.charts.preflight import build_preflight_app  # noqa: E402
from k8s.charts.report import ReportChart, report_job_name, timeline_path  # noqa: E402
from k8s.charts.service_account import ServiceAccountChart  # noqa: E402
from k8s.charts.training import TrainingChart  # noqa: E402
from k8s.job_config import FaultInjectionConfig, JobConfig, JobConfigError  # noqa: E402
from k8s.outputs import OutputsError, load_infra_outputs  # noqa: E402
from training.contract.config import TrainConfigError, load_train_config  # noqa: E402
from training.contract.faults import DESTRUCTIVE_KINDS  # noqa: E402


def load_platform(cdk_json: Path, overrides: list[str]) -> PlatformConfig:
    context = json.loads(cdk_json.read_text()).get("context", {}) if cdk_json.exists() else {}
    known = {PlatformConfig.context_key(f.name) for f in fields(PlatformConfig)}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or key not in known:
            raise ConfigError(f"-c {item!r}: expected key=value with key one of {sorted(known)}")
        context[key] = value
    # A lookup function, like the CDK app's node.try_get_context: CDK's own keys in cdk.json are ignored.
    return PlatformConfig.from_context(context.get)


def build_app(job: JobConfig, outdir: Path) -> cdk8s.App:
    """One chart, one file per concern; the file names sort in `kubectl apply -f dist/` order."""
    app = cdk8s.App(outdir=str(outdir), yaml_output_type=cdk8s.YamlOutputType.FILE_PER_CHART)
    NetworkDefaultsChart(app, "network-defaults", job)
    ServiceAccountChart(app, "service-account", job)
    TrainingChart(app, "training", job)
    if job.hung_node_out_of_service_s is not None:
        HungNodeChart(app, "hung-node-marker", job)
    if job.fault_injection is not None:
        FaultInjectionChart(app, "training-fault-injection", job)
    return app


def build_report_app(job: JobConfig, outdir: Path) -> cdk8s.App:
    app = cdk8s.App(outdir=str(outdir), yaml_output_type=cdk8s.YamlOutputType.FILE_PER_CHART)
    ReportChart(app, "report", job)
    return app


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python k8s/main.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--outdir", type=Path, help="default: dist, with --report dist/report (apart, so that "
                   "`kubectl apply -f dist/` never starts a report)")
    only = p.add_mutually_exclusive_group()
    only.add_argument("--report", action="store_true",
                      help="render only the Job that prints the goodput report of the run on FSx and draws its timeline")
    p.add_argument("--cdk-json", type=Path, default=REPO_ROOT / "cdk.json")
    p.add_argument("-c", "--context", action="append", default=[], metavar="KEY=VALUE",
                   help="platform config override, as for `cdk synth -c`")
    p.add_argument("--outputs", type=Path, default=REPO_ROOT / "cdk-outputs.json",
                   help="`cdk deploy --outputs-file` result (default: %(default)s)")
    p.add_argument("--train-config", type=Path, default=REPO_ROOT / "k8s" / "train.yaml")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="training config override, e.g. fault_tolerance.restart=both")
    p.add_argument("--model-dir", help="model.source=huggingface: a local copy of the model's directory on FSx (its "
                   "config.json is enough), which sizes the Job's checks; default: model.path, if readable here")
    p.add_argument("--job-name", default="fsdp-train")
    p.add_argument("--nodes", type=int, help="training pods (= GPU nodes) in the job; default: gpuNodesDesired")
    p.add_argument("--spares", type=int,
                   help="hot spare pods (standby GPU nodes) beyond --nodes; default: the platform's, gpuNodesSpare "
                        "(unset: 1 where gpuNodesMax leaves room)")
    p.add_argument("--grace-period", type=int,
                   help="pod termination grace seconds; default: ft_launcher's --term-timeout (the drain's time) + "
                        "launcher exit margin")
    p.add_argument("--node-failure-toleration", type=int, default=JobConfig.node_failure_toleration_s,
                   help="seconds a pod stays on an unreachable or not-ready node before it is evicted "
                        "and replaced (default: %(default)s)")
    p.add_argument("--hung-node-out-of-service", type=int, default=JobConfig.hung_node_out_of_service_s,
                   metavar="SECONDS", help="mark a GPU node whose kubelet is silent this long out of service, so that "
                   "its pod is replaced (default: %(default)s; 0: no marker, a hung node's pod waits for EKS auto "
                   "repair, 30 min)")
    p.add_argument("--fault-injection", action="store_true", help="also render the chaos-drill CronJob")
    only.add_argument("--preflight", action="store_true",
                      help="render only the NCCL/EFA preflight MPIJob (nccl-tests all_reduce_perf on every GPU node "
                           "of the Job) instead of the training; needs the MPI Operator")
    p.add_argument("--allow-destructive-faults", action="store_true",
                   help="the chaos switch: let the fault kinds that destroy checkpoints or take a node down "
                        f"({', '.join(sorted(DESTRUCTIVE_KINDS))}) fire in the pods; without it the pods "
                        "refuse them, from the training config and from TRAINING_FAULTS alike")
    p.add_argument("--fault-schedule", default=FaultInjectionConfig.schedule)
    p.add_argument("--fault-target-index", type=int, help="job index whose pod is evicted; default: any, at random")
    p.add_argument("--fault-grace-period", type=int, default=FaultInjectionConfig.grace_period_s,
                   help="seconds the evicted pod gets before SIGKILL (default: %(default)s, like a crash)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        platform = load_platform(args.cdk_json, args.context)
        fault_injection = (FaultInjectionConfig(args.fault_schedule, args.fault_target_index, args.fault_grace_period)
                           if args.fault_injection else None)
        job = JobConfig(platform=platform, train=load_train_config(args.train_config, args.set),
                        infra=load_infra_outputs(platform, args.outputs), name=args.job_name,
                        nodes=args.nodes, spares=args.spares, termination_grace_s=args.grace_period,
                        node_failure_toleration_s=args.node_failure_toleration, fault_injection=fault_injection,
                        hung_node_out_of_service_s=args.hung_node_out_of_service or None,
                        allow_destructive_faults=args.allow_destructive_faults, model_dir=args.model_dir)
        if args.report:
            return _write_report_job(job, args.outdir or REPO_ROOT / "dist" / "report")
        args.outdir = args.outdir or REPO_ROOT / "dist"
        app = build_preflight_app(job, args.outdir) if args.preflight else build_app(job, args.outdir)
    except (ConfigError, TrainConfigError, JobConfigError, OutputsError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    args.outdir.mkdir(parents=True, exist_ok=True)
    for stale in args.outdir.glob("*.k8s.yaml"):  # e.g. a chaos drill rendered by an earlier run
        stale.unlink()
    app.synth()
    print(f"infra outputs: {job.infra.source}")
    shape = (f"{job.replica_groups} replica groups of {job.nodes // job.replica_groups} x {job.instance.name} + "
             f"{job.spares} spare each, one Lighthouse" if job.is_group_set
             else f"{job.nodes} x {job.instance.name} + {job.spares} spare")
    print(f"job {job.name}: {shape}, restart={job.restart_mode}, fault injection {'on' if fault_injection else 'off'}")
    c = job.capacity
    print(f"capacity (projected, `python -m training.plan --nodes {job.nodes} --config ...` for all of it): "
          f"{c.state_bytes / 1e9:.1f} GB per save to FSx {c.fsx.describe()} in {c.save_s:.0f} s, interval "
          f"{c.schedule.interval} steps ~ {c.interval_s:.0f} s, drain grace {c.schedule.drain_timeout_s:g} s")
    for path in sorted(args.outdir.glob("*.k8s.yaml")):
        print(f"wrote {path}")
    return 0


def _write_report_job(job: JobConfig, outdir: Path) -> int:
    outdir.mkdir(parents=True, exist_ok=True)
    build_report_app(job, outdir).synth()
    ns, names = job.namespace, " ".join(report_job_name(group) for group in job.groups)
    print(f"wrote {outdir / 'report.k8s.yaml'}: the report of {', '.join(g.train.run_dir for g in job.groups)}")
    print(f"  kubectl delete job -n {ns} {names} --ignore-not-found && kubectl apply -f {outdir}/")
    for group in job.groups:
        name = report_job_name(group)
        print(f"  kubectl logs -n {ns} -f job/{name}\n"
              f"  kubectl cp -n {ns} $(kubectl get pod -n {ns} -l job-name={name} -o name | cut -d/ -f2):"
              f"{timeline_path(group)} {'timeline.png' if len(job.groups) == 1 else f'timeline-{group.name}.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
