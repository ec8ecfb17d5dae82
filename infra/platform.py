"""Wires the constructs into three stacks: Network -> Storage -> Cluster.

Storage does not depend on the cluster, so the cluster stack can be destroyed and rebuilt while
the FSx file system (and its checkpoints) stays. The outputs the k8s layer reads from
`cdk deploy --outputs-file cdk-outputs.json` have fixed keys, unique across the stacks: Fsx* in
Storage, the rest in Cluster.
"""
from __future__ import annotations

from dataclasses import dataclass

from aws_cdk import Aws, CfnOutput, Environment, Fn, RemovalPolicy, Stack
from constructs import Construct

from infra.cluster import EksCluster, EksClusterProps
from infra.config import NAMESPACE, PVC_NAME, PlatformConfig
from infra.device_plugins import DevicePlugins, DevicePluginsProps
from infra.gpu_nodegroup import GpuNodegroup, GpuNodegroupProps
from infra.image import TrainingImage, TrainingImageProps
from infra.log_archive import LogArchive, LogArchiveProps
from infra.metrics_collection import MetricsCollection, MetricsCollectionProps
from infra.network import Network, NetworkProps
from infra.node_fencing import NodeFencing
from infra.storage import CheckpointStorage, CheckpointStorageProps
from infra.training_volume import TrainingVolume, TrainingVolumeProps


@dataclass(frozen=True)
class PlatformStacks:
    network: Stack
    storage: Stack
    cluster: Stack

    @property
    def stacks(self) -> list[Stack]:
        return [self.network, self.storage, self.cluster]


class PlatformStack(Stack):
    """A stack whose zones are the configured ones. With an account set, Stack.availability_zones is a
    context lookup (`availability-zones:account=…`) that needs AWS credentials at synthesis; the VPC's
    gateway endpoint and flow log ask for it. The config already names the zones, so nothing is looked up."""

    def __init__(self, scope: Construct, construct_id: str, *, zones: list[str], **kwargs) -> None:
        super().__init__(scope, construct_id, **kwargs)
        self._zones = zones

    @property
    def availability_zones(self) -> list[str]:
        return self._zones


def build_platform(scope: Construct, config: PlatformConfig) -> PlatformStacks:
    # The region is always pinned (the configured zones belong to it); the account only when given,
    # and then the zones come from the config, so synthesis needs no credentials either way.
    env = Environment(account=config.account, region=config.region)

    def stack(construct_id: str, description: str) -> Stack:
        stack_name = f"{config.cluster_name}-{construct_id.lower()}"
        return PlatformStack(scope, construct_id, env=env, stack_name=stack_name, description=description,
                             zones=list(config.availability_zones))

    fsx_removal_policy = RemovalPolicy[config.fsx_removal_policy.upper()]  # "retain" -> RETAIN

    network_stack = stack("Network", "VPC, NAT, S3 endpoint, flow logs and the GPU node / EFA security groups")
    log_archive = LogArchiveProps(retention_days=config.log_retention_days)
    network = Network(
        network_stack,
        "Network",
        NetworkProps(
            availability_zones=config.availability_zones,
            gpu_availability_zone=config.gpu_availability_zone,
            gpu_subnet_removal_policy=fsx_removal_policy,
            logs=LogArchive(network_stack, "Logs", log_archive),
        ),
    )

    storage_stack = stack("Storage", "FSx for Lustre for checkpoints, optionally exported to S3")
    storage = CheckpointStorage(
        storage_stack,
        "Checkpoints",
        CheckpointStorageProps(
            vpc=network.vpc,
            subnet=network.gpu_subnet,
            client_security_group=network.node_security_group,
            storage_gib=config.fsx_storage_gib,
            throughput_per_tib=config.fsx_throughput_per_tib,
            export_bucket=config.fsx_export_bucket,
            removal_policy=fsx_removal_policy,
            backup_retention_days=config.fsx_backup_retention_days,
            backup_start_time=config.fsx_backup_start_time,
            import_s3_path=config.fsx_import_s3_path,
            import_fsx_path=config.fsx_import_fsx_path,
        ),
    )

    cluster_stack = stack("Cluster", "EKS cluster, system and GPU node groups, add-ons, device plugins, FSx volume")
    eks_cluster = EksCluster(
        cluster_stack,
        "Eks",
        EksClusterProps(
            cluster_name=config.cluster_name,
            kubernetes_version=config.kubernetes_version,
            vpc=network.vpc,
            api_allowed_cidrs=config.api_allowed_cidrs,
            admin_role_arn=config.admin_role_arn,
            system_instance_type=config.system_instance_type,
            system_nodes=config.system_nodes,
            lustre_client_security_group=network.node_security_group,
            logs=LogArchive(cluster_stack, "Logs", log_archive),
        ),
    )
    cluster = eks_cluster.cluster
    gpu_nodes = GpuNodegroup(
        cluster_stack,
        "GpuNodes",
        GpuNodegroupProps(
            cluster=cluster,
            subnet=network.gpu_subnet,
            node_security_group=network.node_security_group,
            efa_security_group=network.efa_security_group,
            instance=config.instance,
            min_size=config.gpu_nodes_min,
            desired_size=config.gpu_nodes_running,  # the training nodes and their hot spares
            max_size=config.gpu_nodes_max,
            capacity_type=config.capacity_type,
            capacity_reservation_id=config.capacity_reservation_id,
            placement_group_name=config.placement_group_name,
        ),
    )
    gpu_nodes.nodegroup.node.add_dependency(*eks_cluster.node_prerequisites)
    NodeFencing(cluster_stack, "NodeFencing", cluster=cluster)
    DevicePlugins(
        cluster_stack,
        "DevicePlugins",
        DevicePluginsProps(
            cluster=cluster, instance_type=config.gpu_instance_type, efa=config.instance.efa_interfaces > 0
        ),
    )
    TrainingVolume(
        cluster_stack,
        "TrainingVolume",
        TrainingVolumeProps(cluster=cluster, file_system=storage.file_system, storage_gib=config.fsx_storage_gib),
    )
    if config.prometheus_server:
        MetricsCollection(cluster_stack, "MetricsCollection", MetricsCollectionProps(cluster=cluster))
    image = TrainingImage(cluster_stack, "TrainingImage", TrainingImageProps(image_uri=config.image_uri))

    fs = storage.file_system
    kubeconfig = ["aws eks update-kubeconfig --name", cluster.cluster_name, "--region", Aws.REGION]
    if config.admin_role_arn:
        kubeconfig += ["--role-arn", config.admin_role_arn]
    outputs = {
        storage_stack: {"FsxFileSystemId": fs.file_system_id, "FsxDnsName": fs.dns_name, "FsxMountName": fs.mount_name},
        cluster_stack: {
            "ClusterName": cluster.cluster_name,
            "UpdateKubeconfigCommand": Fn.join(" ", kubeconfig),
            "Namespace": NAMESPACE,
            "PvcName": PVC_NAME,
            "ImageUri": image.image_uri,
        },
    }
    for output_stack, values in outputs.items():
        for key, value in values.items():
            CfnOutput(output_stack, key, value=value)
    return PlatformStacks(network=network_stack, storage=storage_stack, cluster=cluster_stack)
