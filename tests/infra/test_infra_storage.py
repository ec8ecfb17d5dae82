"""Storage stack (FSx for Lustre, export bucket) and the namespace/PV/PVC applied to the cluster."""
from __future__ import annotations

import json

from infra.config import NAMESPACE, PV_NAME, PVC_NAME

LUSTRE_PORT_RANGES = [(988, 988), (1018, 1023)]
BACKUPS = {"fsxBackupRetentionDays": 30, "fsxBackupStartTime": "22:30"}


def _file_system(synth) -> dict:
    return synth.one("Storage", "AWS::FSx::FileSystem")


def test_persistent_2_lustre_with_configured_capacity_and_throughput(full):
    fs = _file_system(full)
    assert fs["FileSystemType"] == "LUSTRE"
    assert fs["FileSystemTypeVersion"] == "2.15"
    assert fs["StorageCapacity"] == full.config.fsx_storage_gib
    lustre = fs["LustreConfiguration"]
    assert lustre["DeploymentType"] == "PERSISTENT_2"
    assert lustre["PerUnitStorageThroughput"] == full.config.fsx_throughput_per_tib
    assert lustre["DataCompressionType"] == "LZ4"


def test_encrypted_with_a_rotating_kms_key(full):
    [(_, resource)] = full.resources("Storage", "AWS::FSx::FileSystem").items()
    key_id = resource["Properties"]["KmsKeyId"]["Ref"]
    assert full.templates["Storage"]["Resources"][key_id]["Properties"]["EnableKeyRotation"] is True


def _policies(synth, stack: str, logical_id: str) -> tuple[str, str]:
    resource = synth.templates[stack]["Resources"][logical_id]
    return resource.get("DeletionPolicy", "Delete"), resource.get("UpdateReplacePolicy", "Delete")


def _kept_with_the_file_system(synth) -> dict[str, list[str]]:
    """Stack -> logical ids of what the file system needs after `cdk destroy`: itself, its key, its
    security group and the group's rule between the file servers; the GPU subnet and VPC it sits in."""
    [fs_id] = synth.resources("Storage", "AWS::FSx::FileSystem")
    fs = _file_system(synth)
    group = fs["SecurityGroupIds"][0]["Fn::GetAtt"][0]
    servers_rules = [k for k, v in synth.resources("Storage", "AWS::EC2::SecurityGroupIngress").items()
                     if v["Properties"]["SourceSecurityGroupId"] == {"Fn::GetAtt": [group, "GroupId"]}
                     and v["Properties"]["GroupId"] == {"Fn::GetAtt": [group, "GroupId"]}]
    assert len(servers_rules) == 1
    [vpc] = synth.resources("Network", "AWS::EC2::VPC")
    return {
        "Storage": [fs_id, fs["KmsKeyId"]["Ref"], group, *servers_rules],
        "Network": [vpc, synth.gpu_subnet()],
    }


def test_checkpoints_outlive_the_stack_by_default(defaults):
    for stack, logical_ids in _kept_with_the_file_system(defaults).items():
        for logical_id in logical_ids:
            assert _policies(defaults, stack, logical_id) == ("Retain", "Retain"), (stack, logical_id)
    # What names the GPU nodes' group goes, so that group and the rest of the network can be deleted.
    node_group_id = defaults.security_group("Network", "GPU training nodes")
    node_group = defaults.imported("Network", {"Fn::GetAtt": [node_group_id, "GroupId"]})
    node_rules = [k for k, v in defaults.resources("Storage", "AWS::EC2::SecurityGroupIngress").items()
                  if node_group in (v["Properties"]["GroupId"], v["Properties"]["SourceSecurityGroupId"])]
    assert len(node_rules) == 2 * len(LUSTRE_PORT_RANGES)
    for logical_id in node_rules:
        assert _policies(defaults, "Storage", logical_id) == ("Delete", "Delete")
    other_subnets = set(defaults.resources("Network", "AWS::EC2::Subnet")) - {defaults.gpu_subnet()}
    assert {_policies(defaults, "Network", s) for s in other_subnets} == {("Delete", "Delete")}


def test_destroy_deletes_the_file_system_and_all_kept_for_it(synth):
    destroy = synth({"fsxRemovalPolicy": "destroy"})
    for stack, logical_ids in _kept_with_the_file_system(destroy).items():
        for logical_id in logical_ids:
            assert _policies(destroy, stack, logical_id) == ("Delete", "Delete"), (stack, logical_id)


def test_daily_backups_kept_for_the_configured_days(defaults, synth):
    lustre = _file_system(defaults)["LustreConfiguration"]
    assert (lustre["AutomaticBackupRetentionDays"], lustre["DailyAutomaticBackupStartTime"]) == (7, "03:00")
    lustre = _file_system(synth(BACKUPS))["LustreConfiguration"]
    assert (lustre["AutomaticBackupRetentionDays"], lustre["DailyAutomaticBackupStartTime"]) == (30, "22:30")


def test_file_system_linked_to_the_export_bucket_has_no_backups_and_the_bucket_stays(full):
    lustre = _file_system(full)["LustreConfiguration"]
    assert lustre["AutomaticBackupRetentionDays"] == 0
    assert "DailyAutomaticBackupStartTime" not in lustre
    [bucket] = full.resources("Storage", "AWS::S3::Bucket")
    assert _policies(full, "Storage", bucket) == ("Retain", "Retain")


def test_in_the_gpu_subnet(full):
    assert _file_system(full)["SubnetIds"] == [full.imported("Network", {"Ref": full.gpu_subnet()})]


def test_lustre_ports_open_only_from_the_node_group_and_between_servers(full):
    fsx_group = full.security_group("Storage", "FSx")
    assert _file_system(full)["SecurityGroupIds"] == [{"Fn::GetAtt": [fsx_group, "GroupId"]}]
    node_group = full.security_group("Network", "GPU training nodes")
    node_ref = full.imported("Network", {"Fn::GetAtt": [node_group, "GroupId"]})
    fsx_ref = {"Fn::GetAtt": [fsx_group, "GroupId"]}

    inline = full.templates["Storage"]["Resources"][fsx_group]["Properties"].get("SecurityGroupIngress", [])
    standalone = [r["Properties"] for r in full.resources("Storage", "AWS::EC2::SecurityGroupIngress").values()]
    into_fsx = inline + [r for r in standalone if r["GroupId"] == fsx_ref]
    assert "CidrIp" not in json.dumps(into_fsx)
    from_nodes = sorted((r["IpProtocol"], r["FromPort"], r["ToPort"]) for r in into_fsx if r["SourceSecurityGroupId"] == node_ref)
    assert from_nodes == [("tcp", low, high) for low, high in LUSTRE_PORT_RANGES]
    # Everything else comes from the group's own members: the file servers talking to each other.
    assert {json.dumps(r["SourceSecurityGroupId"]) for r in into_fsx} == {json.dumps(node_ref), json.dumps(fsx_ref)}
    # The nodes accept the servers' callbacks on the same ports.
    back = sorted((r["FromPort"], r["ToPort"]) for r in standalone if r["GroupId"] == node_ref)
    assert back == LUSTRE_PORT_RANGES


def test_export_bucket_and_data_repository_association_when_configured(full, defaults):
    bucket = full.one("Storage", "AWS::S3::Bucket")
    assert bucket["PublicAccessBlockConfiguration"]["BlockPublicAcls"] is True
    association = full.one("Storage", "AWS::FSx::DataRepositoryAssociation")
    assert association["FileSystemPath"] == "/"
    assert sorted(association["S3"]["AutoExportPolicy"]["Events"]) == ["CHANGED", "DELETED", "NEW"]
    [bucket_id] = full.resources("Storage", "AWS::S3::Bucket")
    assert association["DataRepositoryPath"] == {"Fn::Join": ["", ["s3://", {"Ref": bucket_id}]]}
    assert defaults.resources("Storage", "AWS::S3::Bucket") == {}
    assert defaults.resources("Storage", "AWS::FSx::DataRepositoryAssociation") == {}


def _intrinsic(value: dict) -> str:
    """A readable stand-in for a token inside a JSON string, e.g. <Fn::ImportValue:name>."""
    [(function, argument)] = value.items()
    return f"<{function}:{argument}>"


def _manifest(synth) -> list[dict]:
    """The Kubernetes objects of the one manifest, with CloudFormation tokens as <...> stand-ins."""
    [resource] = synth.resources("Cluster", "Custom::AWSCDK-EKS-KubernetesResource").values()
    body = resource["Properties"]["Manifest"]
    if isinstance(body, dict):  # the FSx ids make it a Fn::Join; each token sits inside a JSON string
        body = "".join(p if isinstance(p, str) else _intrinsic(p) for p in body["Fn::Join"][1])
    return json.loads(body)


def test_namespace_pv_and_pvc_applied_in_order_with_shared_names(full):
    namespace, volume, claim = _manifest(full)
    assert (namespace["kind"], namespace["metadata"]["name"]) == ("Namespace", NAMESPACE)
    assert (volume["kind"], volume["metadata"]["name"]) == ("PersistentVolume", PV_NAME)
    assert (claim["kind"], claim["metadata"]["name"], claim["metadata"]["namespace"]) == (
        "PersistentVolumeClaim", PVC_NAME, NAMESPACE
    )


def test_static_volume_binds_the_file_system_read_write_many(full):
    _, volume, claim = _manifest(full)
    [fs_logical_id] = full.resources("Storage", "AWS::FSx::FileSystem")
    file_system_id = _intrinsic(full.imported("Storage", {"Ref": fs_logical_id}))
    csi = volume["spec"]["csi"]
    assert csi["driver"] == "fsx.csi.aws.com"
    assert csi["volumeHandle"] == file_system_id
    assert csi["volumeAttributes"]["dnsname"].startswith(file_system_id + ".fsx.")
    assert csi["volumeAttributes"]["mountname"].startswith("<Fn::ImportValue:")
    capacity = f"{full.config.fsx_storage_gib}Gi"
    assert volume["spec"]["accessModes"] == claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert volume["spec"]["capacity"] == claim["spec"]["resources"]["requests"] == {"storage": capacity}
    assert volume["spec"]["storageClassName"] == claim["spec"]["storageClassName"] == ""
    assert volume["spec"]["persistentVolumeReclaimPolicy"] == "Retain"
    assert claim["spec"]["volumeName"] == PV_NAME


def test_s3_dataset_import_is_an_auto_import_association_when_configured(g6, defaults):
    imported = g6  # the variant that imports a dataset (tests/infra/conftest.py: IMPORT)
    associations = list(imported.resources("Storage", "AWS::FSx::DataRepositoryAssociation").values())
    assert len(associations) == 1
    props = associations[0]["Properties"]
    [fs_id] = imported.resources("Storage", "AWS::FSx::FileSystem")
    assert props["FileSystemId"] == {"Ref": fs_id}
    assert (props["DataRepositoryPath"], props["FileSystemPath"]) == ("s3://example-datasets/corpus/v1", "/datasets")
    assert props["BatchImportMetaDataOnCreate"] is True
    assert props["S3"] == {"AutoImportPolicy": {"Events": ["NEW", "CHANGED", "DELETED"]}}
    assert not defaults.resources("Storage", "AWS::FSx::DataRepositoryAssociation")  # off by default


def test_the_file_system_waits_for_every_lustre_rule_of_its_group(full):
    """FSx refuses to create a file system whose group does not yet admit Lustre (InvalidNetworkSettings):
    every ingress rule of that group must exist first."""
    [(_, resource)] = full.resources("Storage", "AWS::FSx::FileSystem").items()
    group = resource["Properties"]["SecurityGroupIds"][0]["Fn::GetAtt"][0]
    group_id = {"Fn::GetAtt": [group, "GroupId"]}
    rules = {k: v["Properties"] for k, v in full.resources("Storage", "AWS::EC2::SecurityGroupIngress").items()
             if v["Properties"]["GroupId"] == group_id}
    # The servers' rule to each other and the clients' rule on each Lustre port range.
    assert sum(rule["SourceSecurityGroupId"] == group_id for rule in rules.values()) == 1
    assert len(rules) == 1 + len(LUSTRE_PORT_RANGES)
    assert set(rules) <= set(resource.get("DependsOn", []))
