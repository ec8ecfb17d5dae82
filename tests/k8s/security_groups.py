"""What the synthesized stacks' security groups let through (used by test_k8s_cross_layer.py): the groups each
node group's nodes carry, every rule of every stack, and whether a connection from one node to another passes."""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

from infra.config import VPC_CIDR

ALL = "-1"  # IpProtocol of a rule for every protocol and port
INSTANCE_TYPE_LABEL = "node.kubernetes.io/instance-type"  # set by the kubelet (Kubernetes "Well-Known Labels")
GroupKey = tuple[str, str]  # (stack, logical id); EKS's cluster group: (stack, "<cluster id>.ClusterSecurityGroupId")


@dataclass(frozen=True)
class Rule:
    group: GroupKey
    inbound: bool
    peer: GroupKey | str  # a group, or a CIDR
    protocol: str
    from_port: int
    to_port: int

    def admits(self, protocol: str, port: int | None) -> bool:
        """port None: every port of every protocol, which only an all-traffic rule admits."""
        if self.protocol == ALL:
            return True
        return port is not None and self.protocol == protocol and self.from_port <= port <= self.to_port

    def names(self, groups: frozenset[GroupKey]) -> bool:
        """The rule's peer is one of `groups`, or a CIDR that holds every node of the VPC."""
        if isinstance(self.peer, str):
            return ipaddress.ip_network(VPC_CIDR).subnet_of(ipaddress.ip_network(self.peer))
        return self.peer in groups


@dataclass(frozen=True)
class NodeGroup:
    logical_id: str
    labels: Mapping[str, str]  # including the instance type's well-known label
    groups: frozenset[GroupKey]  # the primary interface's: the node's and its pods' IP traffic
    efa_interface_groups: tuple[frozenset[GroupKey], ...]  # one per EFA interface

    def selected_by(self, node_selector: Mapping[str, str]) -> bool:
        return all(self.labels.get(key) == value for key, value in node_selector.items())


class SecurityGroups:
    """The rules of all `templates` (stack name -> template), with cross-stack references resolved."""

    def __init__(self, templates: Mapping[str, dict[str, Any]]) -> None:
        self._templates = templates
        self._exports = {output["Export"]["Name"]: (stack, output["Value"])
                         for stack, template in templates.items()
                         for output in template.get("Outputs", {}).values() if "Export" in output}
        self.rules = list(self._rules())

    def group(self, stack: str, ref: Mapping[str, Any]) -> GroupKey:
        """The group a template value in `stack` names: Ref, GetAtt GroupId, an import, EKS's cluster group."""
        if "Fn::ImportValue" in ref:
            exporting_stack, value = self._exports[ref["Fn::ImportValue"]]
            return self.group(exporting_stack, value)
        if "Fn::GetAtt" in ref:
            logical_id, attribute = ref["Fn::GetAtt"]
            if attribute == "ClusterSecurityGroupId":
                return stack, f"{logical_id}.{attribute}"
            assert attribute == "GroupId", ref
            return stack, logical_id
        assert set(ref) == {"Ref"}, ref
        return stack, ref["Ref"]

    def passes(self, sources: frozenset[GroupKey], targets: frozenset[GroupKey], protocol: str,
               port: int | None) -> bool:
        """A connection from a node carrying `sources` to one carrying `targets` (port None: all traffic): a
        target group admits it from a source group and a source group lets it out. Groups are stateful: the
        reply needs no rule of its own."""
        return (any(r.inbound and r.group in targets and r.admits(protocol, port) and r.names(sources)
                    for r in self.rules)
                and any(not r.inbound and r.group in sources and r.admits(protocol, port) and r.names(targets)
                        for r in self.rules))

    def node_groups(self) -> list[NodeGroup]:
        found = []
        for stack, template in self._templates.items():
            resources = template["Resources"]
            for logical_id, resource in resources.items():
                if resource["Type"] != "AWS::EKS::Nodegroup":
                    continue
                props = resource["Properties"]
                data = resources[props["LaunchTemplate"]["Id"]["Ref"]]["Properties"]["LaunchTemplateData"]
                [instance_type] = props.get("InstanceTypes") or [data["InstanceType"]]
                interfaces = data.get("NetworkInterfaces", [])
                if "SecurityGroupIds" in data:
                    groups = data["SecurityGroupIds"]
                elif interfaces:
                    [primary] = [i for i in interfaces if i["NetworkCardIndex"] == 0 and i["DeviceIndex"] == 0]
                    groups = primary["Groups"]
                else:  # EKS adds its cluster group to a template that names none (EKS user guide, "Customize
                    # managed nodes with launch templates", "Using custom security groups")
                    groups = [{"Fn::GetAtt": [props["ClusterName"]["Ref"], "ClusterSecurityGroupId"]}]
                found.append(NodeGroup(
                    logical_id,
                    {**props.get("Labels", {}), INSTANCE_TYPE_LABEL: instance_type},
                    frozenset(self.group(stack, g) for g in groups),
                    tuple(frozenset(self.group(stack, g) for g in i["Groups"]) for i in interfaces
                          if i.get("InterfaceType") in ("efa", "efa-only")),
                ))
        return found

    def _rules(self) -> Iterator[Rule]:
        for stack, template in self._templates.items():
            for logical_id, resource in template["Resources"].items():
                props = resource.get("Properties", {})
                kind = resource["Type"]
                if kind == "AWS::EKS::Cluster":
                    # The group EKS creates for the control plane and managed nodes: all traffic in from its
                    # members, all out (EKS user guide, "View Amazon EKS security group requirements for
                    # clusters", "Default cluster security group").
                    key = (stack, f"{logical_id}.ClusterSecurityGroupId")
                    yield Rule(key, True, key, ALL, -1, -1)
                    yield Rule(key, False, "0.0.0.0/0", ALL, -1, -1)
                elif kind == "AWS::EC2::SecurityGroup":
                    key = (stack, logical_id)
                    for rule in props.get("SecurityGroupIngress", []):
                        yield self._rule(stack, key, True, rule)
                    # Without inline egress rules EC2 keeps the group's default all-traffic egress rule
                    # (CloudFormation AWS::EC2::SecurityGroup, SecurityGroupEgress).
                    for rule in props.get("SecurityGroupEgress", [{"CidrIp": "0.0.0.0/0", "IpProtocol": ALL}]):
                        yield self._rule(stack, key, False, rule)
                elif kind in ("AWS::EC2::SecurityGroupIngress", "AWS::EC2::SecurityGroupEgress"):
                    yield self._rule(stack, self.group(stack, props["GroupId"]),
                                     kind.endswith("Ingress"), props)

    def _rule(self, stack: str, key: GroupKey, inbound: bool, rule: Mapping[str, Any]) -> Rule:
        peer_ref = rule.get("SourceSecurityGroupId" if inbound else "DestinationSecurityGroupId")
        peer = self.group(stack, peer_ref) if peer_ref else rule["CidrIp"]
        return Rule(key, inbound, peer, str(rule["IpProtocol"]), rule.get("FromPort", -1), rule.get("ToPort", -1))
