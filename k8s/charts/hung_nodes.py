"""The hung-node marker: a small Deployment on the system nodes that fences a GPU node (stops its instance) and
marks it out of service once its kubelet has been silent for JobConfig.hung_node_out_of_service_s
(k8s.mark_hung_nodes says why), so that a hung node's pod is replaced in minutes, not after EKS auto
repair's 30.

Its rights are the narrowest that do it: list and patch Node objects (a ClusterRole: nodes are not
namespaced; RBAC cannot narrow a patch to one field or to labelled nodes, the script patches only the
out-of-service taint of silent GPU nodes, with a resourceVersion test); through its service account's Pod
Identity role, stop this cluster's GPU instances and read instance states (infra.node_fencing). No pod
access: PodGC, not this marker, deletes the pods.
"""
from __future__ import annotations

from pathlib import Path

from cdk8s import Chart
from constructs import Construct

from infra.config import GPU_NODE_LABEL, HUNG_NODE_MARKER_SERVICE_ACCOUNT, SYSTEM_NODE_LABEL
from k8s.charts.fault_injection import PYTHON_IMAGE
from k8s.charts.network import AWS_API, DNS, KUBERNETES_API, POD_IDENTITY_AGENT, network_policy
from k8s.charts.objects import CONTAINER_SECURITY_CONTEXT, POD_SECURITY_CONTEXT, api_object, checkov_skips
from k8s.job_config import JobConfig

MARK_SCRIPT = Path(__file__).resolve().parent.parent / "mark_hung_nodes.py"
CHECKOV_SKIPS = {
    "CKV_K8S_38": "the marker lists and patches nodes through the API: it needs its service account token",
    "CKV_K8S_8": "a poll loop that serves nothing: every API call has a 30 s timeout and a crash restarts the pod",
    "CKV_K8S_9": "no Service sends it traffic: there is nothing to be ready for",
    "CKV_K8S_43": "a fixed release tag of an official image on ECR Public; pin a digest in a mirrored registry if required",
}
RULES = [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["list", "patch"]}]


class HungNodeChart(Chart):
    def __init__(self, scope: Construct, id: str, job: JobConfig) -> None:
        name = f"{job.name}-hung-node-marker"
        super().__init__(scope, id, labels={"app.kubernetes.io/name": name,
                                            "app.kubernetes.io/part-of": job.infra.cluster_name})
        assert job.hung_node_out_of_service_s is not None
        ns = job.namespace
        # The name infra.node_fencing.NodeFencing's Pod Identity association names (infra.config).
        account = HUNG_NODE_MARKER_SERVICE_ACCOUNT
        api_object(self, "service-account", api_version="v1", kind="ServiceAccount", name=account, namespace=ns)
        api_object(self, "cluster-role", api_version="rbac.authorization.k8s.io/v1", kind="ClusterRole", name=name,
                   body={"rules": RULES})
        api_object(self, "cluster-role-binding", api_version="rbac.authorization.k8s.io/v1",
                   kind="ClusterRoleBinding", name=name, body={
                       "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
                       "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": ns}]})
        container = {
            "name": "mark",
            "image": PYTHON_IMAGE,
            "imagePullPolicy": "Always",
            "command": ["python", "-c", MARK_SCRIPT.read_text(), str(job.hung_node_out_of_service_s),
                        f"{GPU_NODE_LABEL}=true", job.platform.region],
            "resources": {"requests": {"cpu": "20m", "memory": "64Mi"}, "limits": {"cpu": "200m", "memory": "128Mi"}},
            "securityContext": {**CONTAINER_SECURITY_CONTEXT, "runAsNonRoot": True, "runAsUser": 65532},
        }
        labels = {"app.kubernetes.io/name": name}
        api_object(self, "deployment", api_version="apps/v1", kind="Deployment", name=name, namespace=ns,
                   annotations=checkov_skips(CHECKOV_SKIPS), body={"spec": {
                       "replicas": 1,
                       "selector": {"matchLabels": labels},
                       "template": {"metadata": {"labels": labels}, "spec": {
                           "serviceAccountName": account,
                           "nodeSelector": {SYSTEM_NODE_LABEL: "true"},  # never on the GPU nodes it watches
                           "securityContext": dict(POD_SECURITY_CONTEXT),
                           "containers": [container],
                       }},
                   }})
        # It reaches the Kubernetes API, the Pod Identity agent and EC2's API, nothing else.
        network_policy(self, "network-policy", job, name, labels,
                       egress=[KUBERNETES_API, DNS, POD_IDENTITY_AGENT, AWS_API])
