"""A chaos drill for a real cluster: a CronJob evicts one training pod on a schedule.

An evicted pod is a fault the Job must absorb: the worker group restarts, with a hot spare in the
lost node's place where there is one, the Job starts a replacement pod for that index, and
training resumes from the last checkpoint; with replica groups, only the pod's group restarts. The eviction (k8s.evict) is allowed in this namespace only, to pods only.
"""
from __future__ import annotations

from pathlib import Path

from cdk8s import Chart
from constructs import Construct

from k8s.charts.network import DNS, KUBERNETES_API, network_policy
from k8s.charts.objects import CONTAINER_SECURITY_CONTEXT, POD_SECURITY_CONTEXT, api_object, checkov_skips
from k8s.charts.training import REPLICA_SET_LABEL
from k8s.job_config import JobConfig

# The Docker official image through ECR Public (no Docker Hub pull limits); registry.k8s.io/kubectl
# is distroless and kubectl cannot evict by label selector.
PYTHON_IMAGE = "public.ecr.aws/docker/library/python:3.13.9-alpine3.22"  # a fixed release, not a moving tag
EVICT_SCRIPT = Path(__file__).resolve().parent.parent / "evict.py"

CHECKOV_SKIPS = {
    "CKV_K8S_38": "the drill evicts pods through the API: it needs its service account token",
    "CKV_K8S_43": "a fixed release tag of an official image on ECR Public; pin a digest in a mirrored registry if required",
}


class FaultInjectionChart(Chart):
    def __init__(self, scope: Construct, id: str, job: JobConfig) -> None:
        super().__init__(scope, id, labels={"app.kubernetes.io/name": f"{job.name}-chaos",
                                            "app.kubernetes.io/part-of": job.infra.cluster_name})
        assert job.fault_injection is not None
        fi = job.fault_injection
        ns, name = job.namespace, f"{job.name}-chaos"
        api_object(self, "service-account", api_version="v1", kind="ServiceAccount", name=name, namespace=ns)
        api_object(self, "role", api_version="rbac.authorization.k8s.io/v1", kind="Role", name=name, namespace=ns,
                   body={"rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]},
                                   {"apiGroups": [""], "resources": ["pods/eviction"], "verbs": ["create"]}]})
        api_object(self, "role-binding", api_version="rbac.authorization.k8s.io/v1", kind="RoleBinding",
                   name=name, namespace=ns, body={
                       "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
                       "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": ns}]})
        # a set of replica groups: a pod of any group's Job (each group takes its own pod's loss)
        selector = (f"{REPLICA_SET_LABEL}={job.set_name}" if job.is_group_set
                    else f"batch.kubernetes.io/job-name={job.name}")
        if fi.target_index is not None:  # else any index, a standby's included
            selector += f",batch.kubernetes.io/job-completion-index={fi.target_index}"
        container = {
            "name": "evict",
            "image": PYTHON_IMAGE,
            "imagePullPolicy": "Always",
            "command": ["python", "-c", EVICT_SCRIPT.read_text(), ns, selector, str(fi.grace_period_s)],
            "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"cpu": "200m", "memory": "128Mi"}},
            "securityContext": {**CONTAINER_SECURITY_CONTEXT, "runAsNonRoot": True, "runAsUser": 65532},
        }
        api_object(self, "cronjob", api_version="batch/v1", kind="CronJob", name=name, namespace=ns,
                   annotations=checkov_skips(CHECKOV_SKIPS), body={"spec": {
                       "schedule": fi.schedule,
                       "concurrencyPolicy": "Forbid",
                       "successfulJobsHistoryLimit": 3,
                       "failedJobsHistoryLimit": 3,
                       "jobTemplate": {"spec": {
                           "backoffLimit": 0,  # a missed drill is not retried: the schedule brings the next
                           "ttlSecondsAfterFinished": 3600,
                           "template": {"metadata": {"labels": {"app.kubernetes.io/name": name}}, "spec": {
                               "restartPolicy": "Never",
                               "serviceAccountName": name,
                               "securityContext": dict(POD_SECURITY_CONTEXT),
                               "containers": [container],
                           }},
                       }},
                   }})
        # The drill reaches the Kubernetes API (kubernetes.default.svc) and nothing else.
        network_policy(self, "network-policy", job, name, {"app.kubernetes.io/name": name},
                       egress=[KUBERNETES_API, DNS])
