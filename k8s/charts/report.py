"""The goodput report of the run on FSx: a small Job (`python k8s/main.py --report`) that runs
`python -m training.report --plot RUN_DIR` on the run directory and prints the report to its log.

The report and its picture are written beside the event log (RUN_DIR/report.json, RUN_DIR/timeline.png),
on FSx, where they stay. To copy the picture out, the pod then waits REPORT_HOLD_S seconds with the
volume mounted, so that `kubectl cp` (which needs a running pod) can reach it; the Job ends by itself.
"""
from __future__ import annotations

import shlex
from pathlib import PurePosixPath

from cdk8s import Chart
from constructs import Construct

from infra.config import SYSTEM_NODE_LABEL
from k8s.charts.network import network_policy
from k8s.charts.objects import CONTAINER_SECURITY_CONTEXT, TRAINING_POD_SECURITY_CONTEXT, api_object, checkov_skips
from k8s.charts.training import IMAGE_CHECKOV_SKIPS, fsx_mounts
from k8s.job_config import JobConfig

CONTAINER = "report"
REPORT_HOLD_S = 600  # long enough for a `kubectl cp` by hand; bounded, so no pod is left behind
# Reading a weeks-long event log and drawing it: a CPU, a few GiB, on a system node (no GPU needed).
REPORT_RESOURCES = {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"cpu": "2", "memory": "4Gi"}}


def _pod_labels(job: JobConfig) -> dict[str, str]:
    return {"app.kubernetes.io/name": job.name, "app.kubernetes.io/component": CONTAINER}


def report_job_name(job: JobConfig) -> str:
    return f"{job.name}-report"


def timeline_path(job: JobConfig) -> PurePosixPath:
    return PurePosixPath(job.train.run_dir) / "timeline.png"


def report_command(job: JobConfig) -> list[str]:
    """The report, then the hold for `kubectl cp`; a report that fails ends the pod at once, failed."""
    run_dir = shlex.quote(job.train.run_dir)
    return ["/bin/sh", "-c",
            f"python -m training.report --plot {run_dir} && "
            f"echo 'kubectl cp needs this pod: it stays {REPORT_HOLD_S} s' && sleep {REPORT_HOLD_S}"]


def _report_job_spec(job: JobConfig) -> dict:
    container = {
        "name": CONTAINER,
        "image": job.infra.image_uri,
        "imagePullPolicy": "IfNotPresent",
        "command": report_command(job),
        # matplotlib keeps its font cache under MPLCONFIGDIR: the root filesystem is read-only
        "env": [{"name": "MPLCONFIGDIR", "value": "/tmp/matplotlib"}],
        "resources": REPORT_RESOURCES,
        "securityContext": dict(CONTAINER_SECURITY_CONTEXT),
        # the run's directory alone: writes report.json and timeline.png (never through a symlink)
        "volumeMounts": [*fsx_mounts(job, read_only=False)[:1], {"name": "tmp", "mountPath": "/tmp"}],
    }
    return {
        "backoffLimit": 0,  # a report that fails once fails again: the log says why
        "activeDeadlineSeconds": REPORT_HOLD_S + 1800,  # the report of a long run, then the hold
        "ttlSecondsAfterFinished": 3600,  # the Job and its log stay an hour after the hold
        "template": {"metadata": {"labels": _pod_labels(job)},
                     "spec": {
                         "restartPolicy": "Never",
                         "automountServiceAccountToken": False,  # it never calls the Kubernetes API
                         "nodeSelector": {SYSTEM_NODE_LABEL: "true"},
                         "securityContext": dict(TRAINING_POD_SECURITY_CONTEXT),
                         "containers": [container],
                         "volumes": [{"name": "fsx", "persistentVolumeClaim": {"claimName": job.infra.pvc_name}},
                                     {"name": "tmp", "emptyDir": {"sizeLimit": "256Mi"}}],
                     }},
    }


def _report_job(scope: Construct, job: JobConfig) -> None:
    api_object(scope, "job", api_version="batch/v1", kind="Job", name=report_job_name(job),
               namespace=job.namespace, annotations=checkov_skips(IMAGE_CHECKOV_SKIPS),
               body={"spec": _report_job_spec(job)})
    # It serves nothing and connects to nothing (FSx is the node's kernel client): no traffic at all.
    network_policy(scope, "network-policy", job, report_job_name(job), _pod_labels(job))


class ReportChart(Chart):
    """The report Job of the run, or with replica groups one per group (each has its own run directory)."""

    def __init__(self, scope: Construct, id: str, job: JobConfig) -> None:
        super().__init__(scope, id, labels={"app.kubernetes.io/name": job.name,
                                            "app.kubernetes.io/part-of": job.infra.cluster_name})
        if not job.is_group_set:
            _report_job(self, job)
            return
        for group in job.groups:
            _report_job(Construct(self, f"group{group.replica_group}"), group)
