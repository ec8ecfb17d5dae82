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


def test_file_system_goes_with_the_stack_and_the_export_bucket_stays(full):
    """A retained file system would hold ENIs in the VPC and make `cdk destroy --all` fail."""
    [file_system] = full.resources("Storage", "AWS::FSx::FileSystem").values()
    assert file_system["DeletionPolicy"] == "Delete"
    [bucket] = full.resources("Storage", "AWS::S3::Bucket").values()
    assert bucket["DeletionPolicy"] == "Retain"


def test_daily_backups_kept_for_the_configured_days(defaults, synth):
    lustre = _file_system(defaults)["LustreConfiguration"]
    assert (lustre["AutomaticBackupRetentionDays"], lustre["DailyAutomaticBackupStartTime"]) == (7, "03:00")
    lustre = _file_system(synth(BACKUPS))["LustreConfiguration"]
    assert (lustre["AutomaticBackupRetentionDays"], lustre["DailyAutomaticBackupStartTime"]) == (30, "22:30")


def test_file_system_linked_to_the_export_bucket_has_no_backups(full):
    lustre = _file_system(full)["LustreConfiguration"]
    assert lustre["AutomaticBackupRetentionDays"] == 0
    assert "DailyAutomaticBackupStartTime" not in lustre


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
