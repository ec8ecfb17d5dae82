"""The GPU node group: EFA on every network card, local NVMe in RAID0, reserved capacity when given."""
from __future__ import annotations

from dataclasses import dataclass

from aws_cdk import Fn, aws_ec2 as ec2, aws_eks_v2 as eks
from constructs import Construct

from infra.config import GPU_NODE_LABEL, GPU_TAINT_KEY
from infra.instances import InstanceFacts
from infra.nag import acknowledge_node_role

ROOT_VOLUME_GIB = 200  # OS and kubelet only: images and pod scratch live on the NVMe RAID0
_HUGEPAGES_PER_GIB = 512  # 2 MiB pages

# nodeadm merges this with the cluster details EKS adds; RAID0 puts containerd and kubelet on NVMe.
_NODE_CONFIG = """\
---
apiVersion: node.eks.aws/v1alpha1
kind: NodeConfig
spec:
  instance:
    localStorage:
      strategy: RAID0
"""


@dataclass(frozen=True)
class GpuNodegroupProps:
    cluster: eks.Cluster
    subnet: ec2.ISubnet
    node_security_group: ec2.ISecurityGroup
    efa_security_group: ec2.ISecurityGroup
    instance: InstanceFacts
    min_size: int
    desired_size: int
    max_size: int
    capacity_type: str  # one of infra.config.CAPACITY_TYPES
    capacity_reservation_id: str | None


class GpuNodegroup(Construct):
    """A managed node group of one GPU instance type, started from its own launch template."""

    placement_group: ec2.PlacementGroup | None
    launch_template: ec2.CfnLaunchTemplate
    nodegroup: eks.Nodegroup

    def __init__(self, scope: Construct, construct_id: str, props: GpuNodegroupProps) -> None:
        super().__init__(scope, construct_id)
        reserved = props.capacity_reservation_id is not None
        capacity_block = props.capacity_type == "capacity-block"
        # A reservation or capacity block already fixes where the instances are; a placement group
        # on top of it can only make launches fail.
        self.placement_group = None
        if not reserved:
            self.placement_group = ec2.PlacementGroup(
                self, "PlacementGroup", strategy=ec2.PlacementGroupStrategy.CLUSTER
            )
        self.launch_template = ec2.CfnLaunchTemplate(
            self,
            "LaunchTemplate",
            launch_template_data=ec2.CfnLaunchTemplate.LaunchTemplateDataProperty(
                # The instance type sits here, not on the node group: aws_eks_v2 rejects p5 with the
                # NVIDIA AMI type when instance_types is given.
                instance_type=props.instance.name,
                network_interfaces=_network_interfaces(props),
                metadata_options=ec2.CfnLaunchTemplate.MetadataOptionsProperty(
                    http_tokens="required",
                    http_endpoint="enabled",
                    # Pods take AWS credentials from Pod Identity, never from the node role.
                    http_put_response_hop_limit=1,
                ),
                block_device_mappings=[
                    ec2.CfnLaunchTemplate.BlockDeviceMappingProperty(
                        device_name="/dev/xvda",
                        ebs=ec2.CfnLaunchTemplate.EbsProperty(
                            volume_size=ROOT_VOLUME_GIB, volume_type="gp3", encrypted=True, delete_on_termination=True
                        ),
                    )
                ],
                user_data=Fn.base64(_user_data(props.instance).render()),
                placement=(
                    ec2.CfnLaunchTemplate.PlacementProperty(group_name=self.placement_group.placement_group_name)
                    if self.placement_group
                    else None
                ),
                capacity_reservation_specification=(
                    ec2.CfnLaunchTemplate.CapacityReservationSpecificationProperty(
                        capacity_reservation_target=ec2.CfnLaunchTemplate.CapacityReservationTargetProperty(
                            capacity_reservation_id=props.capacity_reservation_id
                        )
                    )
                    if reserved
                    else None
                ),
                instance_market_options=(
                    ec2.CfnLaunchTemplate.InstanceMarketOptionsProperty(market_type="capacity-block")
                    if capacity_block
                    else None
                ),
            ),
        )
        self.nodegroup = eks.Nodegroup(
            self,
            "Nodegroup",
            cluster=props.cluster,
            ami_type=eks.NodegroupAmiType.AL2023_X86_64_NVIDIA,
            launch_template_spec=eks.LaunchTemplateSpec(
                id=self.launch_template.ref, version=self.launch_template.attr_latest_version_number
            ),
            capacity_type=(
                eks.CapacityType.CAPACITY_BLOCK if capacity_block else eks.CapacityType.ON_DEMAND
            ),
            subnets=ec2.SubnetSelection(subnets=[props.subnet]),
            min_size=props.min_size,
            desired_size=props.desired_size,
            max_size=props.max_size,
            labels={GPU_NODE_LABEL: "true"},
            taints=[eks.TaintSpec(key=GPU_TAINT_KEY, value="true", effect=eks.TaintEffect.NO_SCHEDULE)],
            # Replaces nodes whose GPUs or network the node monitoring agent reports unhealthy.
            enable_node_auto_repair=True,
        )
        acknowledge_node_role(self.nodegroup.role)


def _network_interfaces(props: GpuNodegroupProps) -> list[ec2.CfnLaunchTemplate.NetworkInterfaceProperty]:
    """One interface per network card. EKS adds no group of its own when the template names any,
    so the cluster group (control plane <-> kubelet) is listed with the node and EFA groups."""
    facts = props.instance
    groups = [props.cluster.cluster_security_group_id, props.node_security_group.security_group_id]
    if facts.efa_interfaces:
        groups.append(props.efa_security_group.security_group_id)
    return [
        ec2.CfnLaunchTemplate.NetworkInterfaceProperty(
            network_card_index=card,
            # The primary interface is device 0; each further card carries its interface as device 1.
            device_index=0 if card == 0 else 1,
            interface_type="efa" if card < facts.efa_interfaces else None,
            groups=groups,
            delete_on_termination=True,
        )
        for card in range(facts.network_cards)
    ]


def _user_data(facts: InstanceFacts) -> ec2.MultipartUserData:
    user_data = ec2.MultipartUserData()
    user_data.add_part(ec2.MultipartBody.from_raw_body(content_type="application/node.eks.aws", body=_NODE_CONFIG))
    if facts.hugepages_2mi_gib:
        # EFA's bounce buffers live in 2 MiB huge pages that pods request; reserve them before the
        # kubelet starts (nodeadm starts it after cloud-init's scripts) so it advertises them.
        pages = facts.hugepages_2mi_gib * _HUGEPAGES_PER_GIB
        script = ec2.UserData.for_linux()
        script.add_commands(
            f"echo 'vm.nr_hugepages = {pages}' > /etc/sysctl.d/90-efa-hugepages.conf",
            "sysctl --load /etc/sysctl.d/90-efa-hugepages.conf",
        )
        user_data.add_part(ec2.MultipartBody.from_user_data(script))
    return user_data
