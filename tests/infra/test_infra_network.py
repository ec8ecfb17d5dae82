"""Network stack: subnets per zone, NAT, S3 gateway endpoint, flow logs, the EFA security group."""
from __future__ import annotations

from infra.network import DISALLOW_ALL_EGRESS


def _subnets(synth, public: bool) -> list[dict]:
    return [
        s["Properties"]
        for s in synth.resources("Network", "AWS::EC2::Subnet").values()
        if s["Properties"]["MapPublicIpOnLaunch"] is public
    ]


def test_private_subnets_in_every_configured_zone(full):
    zones = sorted(s["AvailabilityZone"] for s in _subnets(full, public=False))
    assert zones == sorted(full.config.availability_zones)
    assert len(zones) >= 2  # the EKS control plane needs two


def test_a_nat_gateway_per_zone_in_public_subnets(full):
    assert len(full.resources("Network", "AWS::EC2::NatGateway")) == len(full.config.availability_zones)
    assert len(_subnets(full, public=True)) == len(full.config.availability_zones)


def test_s3_gateway_endpoint(full):
    endpoint = full.one("Network", "AWS::EC2::VPCEndpoint")
    assert endpoint["VpcEndpointType"] == "Gateway"
    assert "s3" in str(endpoint["ServiceName"])


def test_flow_logs_capture_all_traffic(full):
    flow_log = full.one("Network", "AWS::EC2::FlowLog")
    assert flow_log["TrafficType"] == "ALL"
    assert flow_log["ResourceType"] == "VPC"


def test_efa_group_allows_all_traffic_to_and_from_itself_only(full):
    efa = full.security_group("Network", "EFA")
    self_ref = {"Fn::GetAtt": [efa, "GroupId"]}
    ingress = [r["Properties"] for r in full.resources("Network", "AWS::EC2::SecurityGroupIngress").values()
               if r["Properties"]["GroupId"] == self_ref]
    egress = [r["Properties"] for r in full.resources("Network", "AWS::EC2::SecurityGroupEgress").values()
              if r["Properties"]["GroupId"] == self_ref]
    assert [(r["IpProtocol"], r["SourceSecurityGroupId"]) for r in ingress] == [("-1", self_ref)]
    assert [(r["IpProtocol"], r["DestinationSecurityGroupId"]) for r in egress] == [("-1", self_ref)]
    group = full.templates["Network"]["Resources"][efa]["Properties"]
    assert "SecurityGroupIngress" not in group
    # EC2 keeps its default allow-all egress on a group without inline egress rules: the placeholder that
    # matches no traffic is what removes it, so the self rule is the group's only way out.
    assert group["SecurityGroupEgress"] == [DISALLOW_ALL_EGRESS]


def test_default_security_group_is_left_without_rules(full):
    """What launches without a group of its own gets the VPC's default group: a custom resource empties it."""
    vpc = next(iter(full.resources("Network", "AWS::EC2::VPC")))
    restrict = full.one("Network", "Custom::VpcRestrictDefaultSG")
    assert restrict["DefaultSecurityGroupId"] == {"Fn::GetAtt": [vpc, "DefaultSecurityGroup"]}
