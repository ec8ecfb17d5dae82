"""The training pods' service account.

The Namespace itself belongs to the infra stack, which applies it with the FSx PVC that lives in
it: rendering it here too would make `kubectl delete -f dist/` delete the PVC with the namespace.
"""
from __future__ import annotations

from cdk8s import Chart
from constructs import Construct

from infra.config import SERVICE_ACCOUNT
from k8s.charts.objects import api_object
from k8s.job_config import JobConfig


class ServiceAccountChart(Chart):
    def __init__(self, scope: Construct, id: str, job: JobConfig) -> None:
        super().__init__(scope, id, labels={"app.kubernetes.io/part-of": job.infra.cluster_name})
        # Training pods never call the Kubernetes API: no token is mounted.
        api_object(self, "service-account", api_version="v1", kind="ServiceAccount", name=SERVICE_ACCOUNT,
                   namespace=job.namespace, body={"automountServiceAccountToken": False})
