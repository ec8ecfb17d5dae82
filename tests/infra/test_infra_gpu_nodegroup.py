"""GPU node group: launch template (EFA interfaces, IMDSv2, disks, NodeConfig), capacity, scheduling.

`full` is p5.48xlarge on demand; `variant` runs each test for p5en (capacity reservation),
p4d (capacity block) and g6.xlarge (no EFA, on demand).
"""
from __future__ import annotations

from infra.config import GPU_NODE_LABEL, GPU_TAINT_KEY

# EFA interfaces by instance type, written out here as an independent check of infra/instances.py.
EXPECTED_EFA = {"p5.48xlarge": 32, "p5en.48xlarge": 16, "p4d.24xlarge": 4, "g6.xlarge": 0}


def _gpu_nodegroup(synth) -> dict:
    return synth.nodegroup("AL2023_x86_64_NVIDIA")


def _launch_template(synth) -> dict:
    return synth.launch_template(_gpu_nodegroup(synth))


def _imported_group(synth, description_word: str) -> dict:
    """How the cluster stack refers to a network-stack security group."""
    return synth.imported("Network", {"Fn::GetAtt": [synth.security_group("Network", description_word), "GroupId"]})


def _cluster_group(synth) -> dict:
    """The security group EKS creates for the control plane and nodes to talk over."""
    return {"Fn::GetAtt": [next(iter(synth.resources("Cluster", "AWS::EKS::Cluster"))), "ClusterSecurityGroupId"]}


def _user_data(synth) -> str:
    """The MIME document, with the script parts (base64-encoded by CloudFormation) in plain text."""
    body = _launch_template(synth)["UserData"]["Fn::Base64"]
    if isinstance(body, str):
        return body
    return "".join(p if isinstance(p, str) else p["Fn::Base64"] for p in body["Fn::Join"][1])


def test_p5_has_32_efa_interfaces_one_per_network_card(full):
    interfaces = _launch_template(full)["NetworkInterfaces"]
    assert len(interfaces) == 32
    assert [i["NetworkCardIndex"] for i in interfaces] == list(range(32))
    assert [i["DeviceIndex"] for i in interfaces] == [0] + [1] * 31
    # The primary carries the node's IP traffic and an EFA device; the other 31 take no subnet address.
    assert [i["InterfaceType"] for i in interfaces] == ["efa"] + ["efa-only"] * 31


def test_interfaces_follow_the_instance_table(variant):
    facts = variant.config.instance
    interfaces = _launch_template(variant)["NetworkInterfaces"]
    assert facts.efa_interfaces == EXPECTED_EFA[facts.name]
    assert len(interfaces) == facts.network_cards
    assert [i["NetworkCardIndex"] for i in interfaces] == list(range(facts.network_cards))
    assert [i["DeviceIndex"] for i in interfaces] == [0] + [1] * (facts.network_cards - 1)
    efa = [i for i in interfaces if i.get("InterfaceType") in ("efa", "efa-only")]
    assert len(efa) == EXPECTED_EFA[facts.name]
    if efa:
        assert interfaces[0]["InterfaceType"] == "efa"
        assert {i["InterfaceType"] for i in interfaces[1:]} == {"efa-only"}


def test_g6_gets_a_single_normal_interface_without_the_efa_group(g6):
    [interface] = _launch_template(g6)["NetworkInterfaces"]
    assert (interface["NetworkCardIndex"], interface["DeviceIndex"]) == (0, 0)
    assert "InterfaceType" not in interface
    assert interface["Groups"] == [_cluster_group(g6), _imported_group(g6, "GPU training nodes")]


def test_every_interface_carries_cluster_node_and_efa_groups(full):
    expected = [
        _cluster_group(full),
        _imported_group(full, "GPU training nodes"),
        _imported_group(full, "EFA"),
    ]
    assert all(i["Groups"] == expected for i in _launch_template(full)["NetworkInterfaces"])


def test_instance_type_is_in_the_launch_template_not_the_node_group(variant):
    assert _launch_template(variant)["InstanceType"] == variant.config.gpu_instance_type
    assert "InstanceTypes" not in _gpu_nodegroup(variant)


def test_imdsv2_required_one_hop(full):
    # Pods on the pod network cannot reach IMDS (one hop further) and so never get the node role's credentials.
    assert _launch_template(full)["MetadataOptions"] == {
        "HttpTokens": "required", "HttpEndpoint": "enabled", "HttpPutResponseHopLimit": 1
    }


def test_root_volume_is_encrypted_gp3(full):
    [root] = _launch_template(full)["BlockDeviceMappings"]
    assert root["DeviceName"] == "/dev/xvda"
    assert root["Ebs"]["VolumeType"] == "gp3"
    assert root["Ebs"]["Encrypted"] is True


def test_user_data_is_a_nodeadm_mime_document_with_raid0_local_storage(full):
    user_data = _user_data(full)
    assert user_data.startswith("Content-Type: multipart/mixed; boundary=")
    assert "MIME-Version: 1.0" in user_data
    assert "Content-Type: application/node.eks.aws" in user_data
    assert "kind: NodeConfig" in user_data
    assert "localStorage:\n      strategy: RAID0" in user_data


def test_efa_hugepages_reserved_for_efa_instances_only(full, variant):
    pages = full.config.instance.hugepages_2mi_gib * 512
    assert f"vm.nr_hugepages = {pages}" in _user_data(full)
    if variant.config.instance.hugepages_2mi_gib == 0:
        assert "nr_hugepages" not in _user_data(variant)


def test_placement_group_is_created_on_demand_and_taken_from_the_config_with_a_reservation(full, variant):
    def placement(synth):
        groups = synth.resources("Cluster", "AWS::EC2::PlacementGroup")
        return groups, _launch_template(synth).get("Placement")

    groups, ref = placement(full)
    [(logical_id, group)] = groups.items()
    assert group["Properties"]["Strategy"] == "cluster"
    assert ref == {"GroupName": {"Fn::GetAtt": [logical_id, "GroupName"]}}
    config = variant.config
    if config.capacity_type == "capacity-reservation":
        # The reservation was made in this cluster placement group: its instances must launch into it.
        assert config.placement_group_name == "p5en-odcr"
        assert placement(variant) == ({}, {"GroupName": "p5en-odcr"})
    elif config.capacity_type == "capacity-block":
        assert placement(variant) == ({}, None)


def test_capacity_block_group_is_created_at_zero_nodes(variant):
    config = variant.config
    if config.capacity_type != "capacity-block":
        return
    assert _gpu_nodegroup(variant)["ScalingConfig"] == {"MinSize": 0, "DesiredSize": 0, "MaxSize": config.gpu_nodes_max}
    assert config.spare_nodes == 0


def test_updates_replace_one_node_at_a_time_and_reserved_capacity_terminates_first(full, variant):
    assert _gpu_nodegroup(full)["UpdateConfig"] == {"MaxUnavailable": 1}
    expected = {"MaxUnavailable": 1}
    if variant.config.capacity_type != "on-demand":
        expected["UpdateStrategy"] = "MINIMAL"  # a full reservation has no room for a surge node
    assert _gpu_nodegroup(variant)["UpdateConfig"] == expected


def test_auto_repair_takes_no_action_on_xids_an_application_can_cause(full):
    repair = _gpu_nodegroup(full)["NodeRepairConfig"]
    assert repair["Enabled"] is True
    # 13 and 31 are well-known with a default Reboot (EKS user guide, node health, "NVIDIA XID error codes").
    assert repair["NodeRepairConfigOverrides"] == [{
        "NodeMonitoringCondition": "AcceleratedHardwareReady", "NodeUnhealthyReason": f"NvidiaXID{xid}Error",
        "MinRepairWaitTimeMins": 10, "RepairAction": "NoAction",
    } for xid in (13, 31, 109)]


def test_capacity_options(full, variant):
    config = variant.config
    template = _launch_template(variant)
    if config.capacity_type == "on-demand":
        assert "CapacityReservationSpecification" not in template
        assert "InstanceMarketOptions" not in template
        assert _gpu_nodegroup(variant)["CapacityType"] == "ON_DEMAND"
        return
    target = template["CapacityReservationSpecification"]["CapacityReservationTarget"]
    assert target == {"CapacityReservationId": config.capacity_reservation_id}
    if config.capacity_type == "capacity-block":
        assert template["InstanceMarketOptions"] == {"MarketType": "capacity-block"}
        assert _gpu_nodegroup(variant)["CapacityType"] == "CAPACITY_BLOCK"
    else:
        assert "InstanceMarketOptions" not in template
        assert _gpu_nodegroup(variant)["CapacityType"] == "ON_DEMAND"


def test_node_group_ami_labels_taint_repair_and_sizes(full):
    group = _gpu_nodegroup(full)
    config = full.config
    assert group["Labels"] == {GPU_NODE_LABEL: "true"}
    assert group["Taints"] == [{"Key": GPU_TAINT_KEY, "Value": "true", "Effect": "NO_SCHEDULE"}]
    assert group["NodeRepairConfig"]["Enabled"] is True
    # The training nodes and the default hot spare: desired 2 + 1, within max 4.
    assert group["ScalingConfig"] == {
        "MinSize": config.gpu_nodes_min, "DesiredSize": 3, "MaxSize": config.gpu_nodes_max
    }
    assert config.gpu_nodes_desired + config.spare_nodes == 3
    assert _launch_template(full)["InstanceType"] == config.gpu_instance_type  # its own template, latest version


def test_gpu_nodes_run_in_the_gpu_zone_subnet_only(full):
    assert _gpu_nodegroup(full)["Subnets"] == [full.imported("Network", {"Ref": full.gpu_subnet()})]
