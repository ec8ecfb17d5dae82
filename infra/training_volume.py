"""The training namespace and the static PV/PVC that mount the FSx for Lustre file system in pods."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aws_cdk import aws_eks_v2 as eks, aws_fsx as fsx
from constructs import Construct

from infra.config import NAMESPACE, PV_NAME, PVC_NAME

FSX_CSI_DRIVER = "fsx.csi.aws.com"
# Pod Security Admission: enforce baseline (no privileged pod, no host namespaces, ports or paths, only
# baseline's capabilities); warn and audit restricted. Not enforced restricted because two things need root:
# the NCCL preflight's mpirun and sshd (k8s.charts.preflight) and the training pod's fsx-owner init
# container (k8s.charts.training); the trainer, store, report and chaos containers meet restricted.
POD_SECURITY = {
    "pod-security.kubernetes.io/enforce": "baseline",
    "pod-security.kubernetes.io/warn": "restricted",
    "pod-security.kubernetes.io/audit": "restricted",
}


@dataclass(frozen=True)
class TrainingVolumeProps:
    cluster: eks.ICluster
    file_system: fsx.LustreFileSystem
    storage_gib: int


class TrainingVolume(Construct):
    """Namespace, PersistentVolume and PersistentVolumeClaim, applied in that order by one manifest."""

    manifest: eks.KubernetesManifest

    def __init__(self, scope: Construct, construct_id: str, props: TrainingVolumeProps) -> None:
        super().__init__(scope, construct_id)
        fs = props.file_system
        capacity = {"storage": f"{props.storage_gib}Gi"}
        namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE, "labels": POD_SECURITY}}
        volume: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": PV_NAME},
            "spec": {
                "capacity": capacity,
                "volumeMode": "Filesystem",
                "accessModes": ["ReadWriteMany"],
                # Deleting the claim must never touch the checkpoints.
                "persistentVolumeReclaimPolicy": "Retain",
                # Empty class: bind to this volume only, never to a dynamically provisioned one.
                "storageClassName": "",
                "mountOptions": ["flock"],  # NVRx and DCP lock files on shared storage
                "csi": {
                    "driver": FSX_CSI_DRIVER,
                    "volumeHandle": fs.file_system_id,
                    "volumeAttributes": {"dnsname": fs.dns_name, "mountname": fs.mount_name},
                },
            },
        }
        claim = {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": PVC_NAME, "namespace": NAMESPACE},
            "spec": {
                "accessModes": ["ReadWriteMany"],
                "storageClassName": "",
                "volumeName": PV_NAME,
                "resources": {"requests": capacity},
            },
        }
        self.manifest = eks.KubernetesManifest(
            self, "Manifest", cluster=props.cluster, manifest=[namespace, volume, claim]
        )
