"""FSx for Lustre for checkpoints and run directories, optionally exported to S3."""
from __future__ import annotations

from dataclasses import dataclass

from aws_cdk import Duration, RemovalPolicy, Stack, aws_ec2 as ec2, aws_fsx as fsx, aws_kms as kms, aws_s3 as s3
from constructs import Construct

from infra.nag import acknowledge

# Lustre: 988 for LNet, 1018-1023 for the servers' connections back to clients; both open between the file
# servers and from and to the clients (FSx for Lustre user guide, "File system access control with Amazon VPC";
# "Creating an FSx for Lustre file system fails" names the same ports).
LUSTRE_PORTS = ((988, 988), (1018, 1023))


@dataclass(frozen=True)
class CheckpointStorageProps:
    vpc: ec2.IVpc
    subnet: ec2.ISubnet  # the GPU subnet: Lustre is single-zone, keep it beside the nodes
    client_security_group: ec2.ISecurityGroup  # carried by every node that mounts the file system
    storage_gib: int
    throughput_per_tib: int
    export_bucket: bool
    removal_policy: RemovalPolicy  # of the file system and of what it needs to stay usable
    backup_retention_days: int  # 0: no automatic backups
    backup_start_time: str  # HH:MM UTC
    import_s3_path: str | None = None  # s3://bucket/prefix imported at import_fsx_path; None: no import
    import_fsx_path: str = "/datasets"


class CheckpointStorage(Construct):
    """A PERSISTENT_2 Lustre file system reachable on the Lustre ports from the client group only.

    With RemovalPolicy.RETAIN the file system outlives the stack together with its KMS key, its
    security group and the group's rule between the file servers, so it can still be mounted (or
    backed up) after `cdk destroy`.
    """

    file_system: fsx.LustreFileSystem
    bucket: s3.Bucket | None

    def __init__(self, scope: Construct, construct_id: str, props: CheckpointStorageProps) -> None:
        super().__init__(scope, construct_id)
        # "from GPU nodes only" predates the system nodes' joining the client group: a new description would
        # replace the group, and with it the file system (FSx SecurityGroupIds changes require replacement).
        security_group = ec2.SecurityGroup(
            self, "SecurityGroup", vpc=props.vpc, description="FSx for Lustre: Lustre ports from GPU nodes only"
        )
        # Clients in; LustreFileSystem itself admits the group's own members (the file servers).
        # The servers also call clients back: that rule is written here, as the network stack
        # must not depend on storage.
        for index, (low, high) in enumerate(LUSTRE_PORTS):
            security_group.add_ingress_rule(
                props.client_security_group, ec2.Port.tcp_range(low, high), "Lustre from the client nodes"
            )
            ec2.CfnSecurityGroupIngress(
                self,
                f"ClientIngress{index}",
                group_id=props.client_security_group.security_group_id,
                source_security_group_id=security_group.security_group_id,
                ip_protocol="tcp",
                from_port=low,
                to_port=high,
                description="Lustre from the file servers",
            )

        self.file_system = fsx.LustreFileSystem(
            self,
            "FileSystem",
            vpc=props.vpc,
            vpc_subnet=props.subnet,
            security_group=security_group,
            storage_capacity_gib=props.storage_gib,
            file_system_type_version=fsx.FileSystemTypeVersion.V_2_15,
            kms_key=kms.Key(
                self,
                "Key",
                description="FSx for Lustre checkpoints",
                enable_key_rotation=True,
                # Without its key a retained file system and its backups could not be read.
                removal_policy=props.removal_policy,
            ),
            lustre_configuration=fsx.LustreConfiguration(
                deployment_type=fsx.LustreDeploymentType.PERSISTENT_2,
                per_unit_storage_throughput=props.throughput_per_tib,
                data_compression_type=fsx.LustreDataCompressionType.LZ4,
                automatic_backup_retention=Duration.days(props.backup_retention_days),
                daily_automatic_backup_start_time=(  # CDK refuses a backup window without backups
                    _daily_time(props.backup_start_time) if props.backup_retention_days else None
                ),
            ),
            removal_policy=props.removal_policy,
        )
        # FSx checks the group's Lustre rules when it creates the file system and fails with
        # InvalidNetworkSettings if a rule is not in place yet; each rule is its own resource, which
        # CloudFormation may create beside the file system (aws/aws-parallelcluster issue 6181, fixed by
        # PR 6342 with DependsOn from the file system to the rules).
        for rule in _ingress_rules_of(security_group):
            self.file_system.node.add_dependency(rule)
        # Deleting the group would fail while the retained file servers use it. The servers' rule to
        # each other stays with it; the rules naming the GPU nodes' group go, or that group (in the
        # network stack) could not be deleted.
        security_group.apply_removal_policy(props.removal_policy)
        for rule in security_group.node.find_all():
            if (isinstance(rule, ec2.CfnSecurityGroupIngress)
                    and rule.source_security_group_id == security_group.security_group_id):
                rule.apply_removal_policy(props.removal_policy)
        self.bucket = self._export_bucket() if props.export_bucket else None
        if props.import_s3_path:
            self._import_dataset(props.import_s3_path, props.import_fsx_path)

    def _import_dataset(self, s3_path: str, fsx_path: str) -> None:
        """The objects under `s3_path` appear as files under `fsx_path`: listed when the association is
        created, kept up with new, changed and deleted objects, their content loaded on first read (lazy
        load: a run reads from Lustre, not S3). FSx reads the bucket with its service-linked role."""
        fsx.CfnDataRepositoryAssociation(
            self,
            "ImportAssociation",
            file_system_id=self.file_system.file_system_id,
            file_system_path=fsx_path,
            data_repository_path=s3_path,
            batch_import_meta_data_on_create=True,
            s3=fsx.CfnDataRepositoryAssociation.S3Property(
                auto_import_policy=fsx.CfnDataRepositoryAssociation.AutoImportPolicyProperty(
                    events=["NEW", "CHANGED", "DELETED"]
                ),
            ),
        )

    def _export_bucket(self) -> s3.Bucket:
        """A bucket linked to the whole file system: new and changed files are exported automatically."""
        bucket = s3.Bucket(
            self,
            "ExportBucket",
            encryption=s3.BucketEncryption.S3_MANAGED,
            block_public_access=s3.BlockPublicAccess.BLOCK_ALL,
            enforce_ssl=True,
            versioned=True,
            removal_policy=RemovalPolicy.RETAIN,
        )
        acknowledge(
            bucket,
            "AwsSolutions-S1",
            "Only FSx writes to this bucket (data repository export); its access is the file system's own, "
            "so per-request access logs would add a bucket and record nothing new.",
        )
        fsx.CfnDataRepositoryAssociation(
            self,
            "ExportAssociation",
            file_system_id=self.file_system.file_system_id,
            file_system_path="/",
            data_repository_path=f"s3://{bucket.bucket_name}",
            # A file system created anew (e.g. after the old one was deleted) sees the exported checkpoints.
            batch_import_meta_data_on_create=True,
            s3=fsx.CfnDataRepositoryAssociation.S3Property(
                auto_export_policy=fsx.CfnDataRepositoryAssociation.AutoExportPolicyProperty(
                    events=["NEW", "CHANGED", "DELETED"]
                ),
            ),
        )
        return bucket


def _ingress_rules_of(security_group: ec2.SecurityGroup) -> list[ec2.CfnSecurityGroupIngress]:
    """Every separate ingress rule of `security_group`, wherever in its stack CDK placed it."""
    return [rule for rule in Stack.of(security_group).node.find_all()
            if isinstance(rule, ec2.CfnSecurityGroupIngress) and rule.group_id == security_group.security_group_id]


def _daily_time(hh_mm: str) -> fsx.DailyAutomaticBackupStartTime:
    hour, minute = hh_mm.split(":")
    return fsx.DailyAutomaticBackupStartTime(hour=int(hour), minute=int(minute))
