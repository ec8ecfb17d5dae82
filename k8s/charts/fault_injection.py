"""A chaos drill for a real cluster: a CronJob deletes one training pod on a schedule.

Deleting a pod is a fault the Job must absorb: ft_launcher on the other nodes restarts the worker
group, the Job starts a replacement pod for that index, and training resumes from the last
checkpoint. The pod deletion is allowed in this namespace only, to pods only.
"""
from __future__ import annotations

from cdk8s import Chart
from constructs import Construct

from k8s.charts.objects import api_object, checkov_skips
from k8s.job_config import JobConfig

KUBECTL_IMAGE = "registry.k8s.io/kubectl:v1.34.1"  # distroless, entrypoint kubectl

CHECKOV_SKIPS = {
    "CKV_K8S_38": "the drill deletes pods through the API: it needs its service account token",
    "CKV_K8S_43": "an upstream release tag of registry.k8s.io; pin a digest in a mirrored registry if required",
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
                   body={"rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "delete"]}]})
        api_object(self, "role-binding", api_version="rbac.authorization.k8s.io/v1", kind="RoleBinding",
                   name=name, namespace=ns, body={
                       "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
                       "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": ns}]})
        selector = (f"batch.kubernetes.io/job-name={job.name},"
                    f"batch.kubernetes.io/job-completion-index={job.fault_target_index}")
        container = {
            "name": "kubectl",
            "image": KUBECTL_IMAGE,
            "imagePullPolicy": "Always",
            "args": ["delete", "pod", "--namespace", ns, "--selector", selector,
                     f"--grace-period={fi.grace_period_s}", "--wait=false", "--ignore-not-found"],
            "env": [{"name": "HOME", "value": "/tmp"}],  # kubectl's discovery cache; the root is read-only
            "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
            "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"cpu": "200m", "memory": "128Mi"}},
            "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                "runAsNonRoot": True, "runAsUser": 65532, "capabilities": {"drop": ["ALL"]}},
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
                           "template": {"spec": {
                               "restartPolicy": "Never",
                               "serviceAccountName": name,
                               "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
                               "containers": [container],
                               "volumes": [{"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}}],
                           }},
                       }},
                   }})
