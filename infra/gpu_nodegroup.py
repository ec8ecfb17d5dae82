"""The GPU node group: EFA on every network card, local NVMe in RAID0, reserved capacity when given."""
from __future__ import annotations

from dataclasses import dataclass

from aws_cdk import CfnTag, Fn, aws_ec2 as ec2, aws_eks_v2 as eks
from constructs import Construct

from infra.config import GPU_NODE_LABEL, GPU_TAINT_KEY
from infra.instances import InstanceFacts
from infra.node_defaults import IMDS_V2_ONE_HOP, encrypted_root_volume, node_role
from infra.node_fencing import FENCE_TAG

# Node auto repair acts on what the node monitoring agent reports: a well-known XID sets
# AcceleratedHardwareReady false with reason NvidiaXID<n>Error, and EKS reboots or replaces the node 10
# minutes later (EKS user guide, "Detect node health issues with the EKS node monitoring agent", table
# "NVIDIA XID error codes"). That table makes XID 13 (graphics engine exception, "typically caused by
# software issues") and XID 31 (GPU memory page fault: an application's access to unmapped memory)
# well-known, default Reboot; the node repair page's own example overrides XID 31 to NoAction. Both are
# what a bad kernel or an out-of-bounds access in the training code raises: a reboot would cost the node
# and count the pod against the Job's retries, while the job's own restart handles them. XID 109 (context
# switch timeout) is well-known in the agent (aws/eks-node-monitoring-agent,
# monitors/nvidia/dcgm/dcgm_policies.go), yet NVIDIA's XID catalog lists a user application hang among its
# causes. XID 43 (channel stopped) is not well-known: only an event. A real fault shows up again in DCGM
# diagnostics or as a hardware XID (48, 63, 64, 74, 79, …), which keep their default repair.
APPLICATION_XID_OVERRIDES = (13, 31, 109)
REPAIR_WAIT_MINUTES = 10  # the EKS default delay; an override must state every field

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
    placement_group_name: str | None  # the reservation's cluster placement group (capacity-reservation)


class GpuNodegroup(Construct):
    """A managed node group of one GPU instance type, started from its own launch template."""

    placement_group: ec2.PlacementGroup | None
    launch_template: ec2.CfnLaunchTemplate
    nodegroup: eks.Nodegroup

    def __init__(self, scope: Construct, construct_id: str, props: GpuNodegroupProps) -> None:
        super().__init__(scope, construct_id)
        reserved = props.capacity_reservation_id is not None
        capacity_block = props.capacity_type == "capacity-block"
        # On demand: a cluster placement group of our own. A reservation made for EFA lives in a cluster
        # placement group and its instances must launch into that group (placementGroupName); EC2
        # places a capacity block itself.
        self.placement_group = None
        placement_group_name = props.placement_group_name
        if not reserved:
            self.placement_group = ec2.PlacementGroup(
                self, "PlacementGroup", strategy=ec2.PlacementGroupStrategy.CLUSTER
            )
            placement_group_name = self.placement_group.placement_group_name
        self.launch_template = ec2.CfnLaunchTemplate(
            self,
            "LaunchTemplate",
            launch_template_data=ec2.CfnLaunchTemplate.LaunchTemplateDataProperty(
                # The instance type sits here, not on the node group: aws_eks_v2 rejects p5 with the
                # NVIDIA AMI type when instance_types is given.
                instance_type=props.instance.name,
                network_interfaces=_network_interfaces(props),
                metadata_options=IMDS_V2_ONE_HOP,
                block_device_mappings=[encrypted_root_volume(ROOT_VOLUME_GIB)],
                user_data=Fn.base64(_user_data(props.instance).render()),
                # Tags the instances launched from this template (CloudFormation AWS::EC2::LaunchTemplate,
                # TagSpecification; the node group's own tags stay on the node group): the hung-node marker may
                # stop only these (infra.node_fencing).
                tag_specifications=[ec2.CfnLaunchTemplate.TagSpecificationProperty(
                    resource_type="instance", tags=[CfnTag(key=FENCE_TAG, value=props.cluster.cluster_name)])],
                placement=(
                    ec2.CfnLaunchTemplate.PlacementProperty(group_name=placement_group_name)
                    if placement_group_name
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
            node_role=node_role(self, "NodeRole"),
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
            # One node at a time: a launch-template change recycles every GPU node.
            max_unavailable=1,
        )
        cfn = self.nodegroup.node.default_child
        # Escape hatches for what the aws_eks_v2 L2 does not expose (CloudFormation AWS::EKS::Nodegroup):
        # per-XID repair overrides, and, on reserved capacity, the MINIMAL update strategy: the default
        # one launches the new node before it terminates the old, which a full reservation cannot do,
        # so an update would wait on capacity that never comes (EKS user guide, "managed node update
        # behavior"; CfnNodegroup.UpdateConfigProperty.update_strategy).
        cfn.add_property_override("NodeRepairConfig.NodeRepairConfigOverrides", [
            {"NodeMonitoringCondition": "AcceleratedHardwareReady", "NodeUnhealthyReason": f"NvidiaXID{xid}Error",
             "MinRepairWaitTimeMins": REPAIR_WAIT_MINUTES, "RepairAction": "NoAction"}
            for xid in APPLICATION_XID_OVERRIDES
        ])
        if props.capacity_type != "on-demand":
            cfn.add_property_override("UpdateConfig.UpdateStrategy", "MINIMAL")


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
            interface_type=_interface_type(card, facts),
            groups=groups,
            delete_on_termination=True,
        )
        for card in range(facts.network_cards)
    ]


def _interface_type(card: int, facts: InstanceFacts) -> str | None:
    """The primary card's interface is `efa` (EFA with ENA: the node's IP traffic and one EFA device);
    every other EFA card's is `efa-only`, which takes no IP address from the subnet (EKS user guide,
    "EFA and EFA-only interfaces": card 0 cannot be EFA-only, VPC CNI 1.18.5 or later; terraform-aws-eks
    does the same). None: a plain interface, on cards without EFA."""
    if card >= facts.efa_interfaces:
        return None
    return "efa" if card == 0 else "efa-only"


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
