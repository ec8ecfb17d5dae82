"""The VPC the platform lives in, and the security groups the GPU nodes carry."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from aws_cdk import RemovalPolicy, aws_ec2 as ec2
from constructs import Construct

from infra.config import VPC_CIDR
from infra.log_archive import LogArchive

# One /18 per zone: each p5 node takes an IP for every EFA interface plus one per pod.
_PRIVATE_CIDR_MASK = 18
# aws-cdk-lib's rule for a group that allows no outbound traffic (aws-ec2 security-group.ts, MATCH_NO_TRAFFIC):
# ICMP type 252 code 86 to a host that cannot exist; any inline rule removes EC2's default allow-all egress.
DISALLOW_ALL_EGRESS = {"CidrIp": "255.255.255.255/32", "Description": "Disallow all traffic", "IpProtocol": "icmp",
                       "FromPort": 252, "ToPort": 86}
_PUBLIC_CIDR_MASK = 24


@dataclass(frozen=True)
class NetworkProps:
    availability_zones: Sequence[str]  # the control plane needs two; system nodes spread over all
    gpu_availability_zone: str  # GPU nodes and FSx share one zone: no cross-zone hops, one placement group
    # The file system's: a retained one keeps its network interfaces in the GPU subnet, and CloudFormation
    # could delete neither that subnet nor the VPC, so `cdk destroy` would fail on this stack.
    gpu_subnet_removal_policy: RemovalPolicy
    logs: LogArchive  # the stack's: the flow logs' group


class Network(Construct):
    """VPC with public subnets (NAT) and private subnets in every zone, flow logs, an S3 gateway."""

    vpc: ec2.Vpc
    gpu_subnet: ec2.ISubnet
    node_security_group: ec2.SecurityGroup
    efa_security_group: ec2.SecurityGroup

    def __init__(self, scope: Construct, construct_id: str, props: NetworkProps) -> None:
        super().__init__(scope, construct_id)
        self.vpc = ec2.Vpc(
            self,
            "Vpc",
            ip_addresses=ec2.IpAddresses.cidr(VPC_CIDR),
            availability_zones=list(props.availability_zones),
            # A NAT gateway per zone: a zone outage must not cut the other zone's nodes off the registries.
            nat_gateways=len(props.availability_zones),
            subnet_configuration=[
                ec2.SubnetConfiguration(name="public", subnet_type=ec2.SubnetType.PUBLIC, cidr_mask=_PUBLIC_CIDR_MASK),
                ec2.SubnetConfiguration(
                    name="private", subnet_type=ec2.SubnetType.PRIVATE_WITH_EGRESS, cidr_mask=_PRIVATE_CIDR_MASK
                ),
            ],
            # The default group, which anything launched without a group of its own gets, admits its members
            # and lets all traffic out: a custom resource removes its rules (CIS AWS Foundations 5.4).
            restrict_default_security_group=True,
        )
        # Image layers and checkpoint exports go to S3 without paying for NAT traffic.
        self.vpc.add_gateway_endpoint("S3", service=ec2.GatewayVpcEndpointAwsService.S3)
        flow_log_group = props.logs.log_group(self, "FlowLogs")
        self.vpc.add_flow_log(
            "FlowLog",
            destination=ec2.FlowLogDestination.to_cloud_watch_logs(flow_log_group),
            traffic_type=ec2.FlowLogTrafficType.ALL,
            max_aggregation_interval=ec2.FlowLogMaxAggregationInterval.ONE_MINUTE,
        )
        self.gpu_subnet = self.vpc.select_subnets(
            subnet_type=ec2.SubnetType.PRIVATE_WITH_EGRESS,
            availability_zones=[props.gpu_availability_zone],
        ).subnets[0]
        self.gpu_subnet.apply_removal_policy(props.gpu_subnet_removal_policy)
        self.vpc.apply_removal_policy(props.gpu_subnet_removal_policy)

        # The FSx for Lustre clients' group, on every node whose pods mount the checkpoint volume: the GPU
        # nodes (training) and the system nodes (rendezvous store, report Job). FSx admits Lustre traffic from
        # it alone. Its description predates the system nodes; it stays, since a new description replaces the
        # group (EC2 GroupDescription is immutable) and CloudFormation cannot change an export other stacks use.
        self.node_security_group = ec2.SecurityGroup(
            self, "NodeSecurityGroup", vpc=self.vpc, description="GPU training nodes (FSx for Lustre clients)"
        )
        # EFA's OS-bypass traffic must be allowed in and out to the group itself, and nothing else.
        self.efa_security_group = ec2.SecurityGroup(
            self,
            "EfaSecurityGroup",
            vpc=self.vpc,
            description="EFA: all traffic to and from members of this group",
            allow_all_outbound=False,
        )
        self.efa_security_group.add_ingress_rule(self.efa_security_group, ec2.Port.all_traffic(), "EFA from itself")
        self.efa_security_group.add_egress_rule(self.efa_security_group, ec2.Port.all_traffic(), "EFA to itself")
        # The self rule is a resource of its own (a group cannot name itself inline), so the group has no inline
        # egress and EC2 would keep its default allow-all rule ("removed only when you specify one or more egress
        # rules in the SecurityGroupEgress property": CloudFormation, AWS::EC2::SecurityGroup). CDK's own
        # placeholder rule (what it writes for a closed group without rules) removes it.
        cfn_efa = self.efa_security_group.node.default_child
        assert isinstance(cfn_efa, ec2.CfnSecurityGroup)
        cfn_efa.add_property_override("SecurityGroupEgress", [DISALLOW_ALL_EGRESS])

