"""The typed, validated platform config, read from CDK context (cdk.json, `-c key=value`).

Both the CDK app (infra/) and the cdk8s app (k8s/) build their resources from one
`PlatformConfig`, and share the fixed names below, so the names a pod mounts are the names
the stacks create. Every bad value fails here, before synthesis, naming the key, the value
and what is allowed.
"""
from __future__ import annotations

import ipaddress
import json
import re
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Literal, Mapping, get_args, get_origin, get_type_hints

from infra.instances import INSTANCE_TYPES, InstanceFacts, instance_facts

# Facts shared by the stacks and the charts: one place each.
NAMESPACE = "training"
# The hung-node marker's service account in NAMESPACE (k8s.charts.hung_nodes), whose Pod Identity role may
# stop GPU instances (infra.node_fencing).
HUNG_NODE_MARKER_SERVICE_ACCOUNT = "hung-node-marker"
SERVICE_ACCOUNT = "trainer"
PVC_NAME = "fsx-checkpoints"
PV_NAME = "fsx-checkpoints-pv"
CHECKPOINT_MOUNT_PATH = "/fsx"
RENDEZVOUS_PORT = 29500
GPU_TAINT_KEY = "nvidia.com/gpu"
GPU_NODE_LABEL = "platform.training/gpu-node"
SYSTEM_NODE_LABEL = "platform.training/system-node"
# The training image's user (training/Dockerfile USER): the trainer, the store and the report run as it
# and own the Job's directory on FSx. Above 10000: no clash with a node's own users.
TRAINING_UID = 10001
VPC_CIDR = "10.0.0.0/16"
MONITORING_NAMESPACE = "monitoring"  # the optional Prometheus server's (infra.metrics_collection)

# Closed sets: a field of one of these types is checked against its values (_check_choices), and a refusal
# lists them, followed by the field's `choices_note` metadata where it has one.
# The default is the newest in EKS standard support. EKS release calendar (EKS user guide, "Understand the
# Kubernetes version lifecycle on EKS"): standard support ended for 1.33 on 2026-07-29 and for 1.34 on
# 2026-12-02, after which a cluster pays extended support by the hour; 1.35 (EKS release 2026-01-27) has it
# until 2027-03-27. EKS lists add-on builds for 1.36 (the sources in infra.addon_pins). The older
# versions stay selectable, for a cluster that must match another.
KubernetesVersion = Literal["1.33", "1.34", "1.35", "1.36"]
GpuInstanceType = Literal[tuple(sorted(INSTANCE_TYPES))]  # type: ignore[valid-type]  # the instance table's
CapacityType = Literal["on-demand", "capacity-reservation", "capacity-block"]
FsxThroughputPerTib = Literal[125, 250, 500, 1000]
# CloudFormation can retain or delete a file system; it cannot snapshot one (DeletionPolicy Snapshot).
FsxRemovalPolicy = Literal["retain", "destroy"]
# The retention periods CloudWatch Logs accepts (AWS::Logs::LogGroup RetentionInDays), in days.
LogRetentionDays = Literal[1, 3, 5, 7, 14, 30, 60, 90, 120, 150, 180, 365, 400, 545, 731, 1096, 1827, 2192, 2557,
                           2922, 3288, 3653]
KUBERNETES_VERSIONS: tuple[str, ...] = get_args(KubernetesVersion)
CAPACITY_TYPES: tuple[str, ...] = get_args(CapacityType)
LOG_RETENTION_DAYS: tuple[int, ...] = get_args(LogRetentionDays)
FSX_MAX_BACKUP_RETENTION_DAYS = 90

_RESERVATION_ID = re.compile(r"^cr-[0-9a-f]{8}([0-9a-f]{9})?$")
_ROLE_ARN = re.compile(r"^arn:aws[a-z-]*:iam::\d{12}:role/[\w+=,.@/-]{1,512}$")
_ACCOUNT = re.compile(r"^\d{12}$")
_REGION = re.compile(r"^[a-z]{2}(-gov)?-[a-z]+-\d$")
_IMAGE_URI = re.compile(r"^[\w.-]+(:\d+)?(/[\w.-]+)+(:[\w.-]+|@sha256:[0-9a-f]{64})$")
_NAME = re.compile(r"^[a-z][a-z0-9-]{0,62}$")
_S3_PATH = re.compile(r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/[^\s]*)?$")
_FSX_PATH = re.compile(r"^(/[\w.-]+)+$")
_DAILY_TIME = re.compile(r"^([01]\d|2[0-3]):[0-5]\d$")
_PLACEMENT_GROUP = re.compile(r"^[\w.+=@,:-]{1,255}$")
# A platform key is camelCase; CDK's own keys carry a ':' or '/' (aws:cdk:…, @aws-cdk/…) or a '-'.
_CAMEL_CASE = re.compile(r"^[a-z][a-zA-Z0-9]*$")


class ConfigError(ValueError):
    """A config value is not allowed; the message names the key, the value and what is allowed."""


@dataclass(frozen=True)
class PlatformConfig:
    """Everything `cdk deploy` and `make manifests` need to know. Keys are the CDK context names."""

    cluster_name: str = "ft-training"
    account: str | None = None  # None: environment-agnostic stacks (offline synthesis)
    region: str = "us-east-1"
    availability_zones: tuple[str, ...] = ("us-east-1a", "us-east-1b")
    gpu_availability_zone: str = "us-east-1a"
    kubernetes_version: KubernetesVersion = field(
        default="1.36",
        metadata={"choices_note": "(1.33 and 1.34 are in EKS extended support, billed per cluster hour)"})
    gpu_instance_type: GpuInstanceType = "p5.48xlarge"
    gpu_nodes_min: int = 2
    gpu_nodes_desired: int = 2
    gpu_nodes_max: int = 4
    # Hot spare GPU nodes beyond gpu_nodes_desired (the training size); None: one where gpuNodesMax
    # leaves room for it (see spare_nodes).
    gpu_nodes_spare: int | None = None
    capacity_type: CapacityType = "on-demand"
    capacity_reservation_id: str | None = None
    # The cluster placement group an EFA reservation was made in (capacity-reservation only): its
    # instances must launch into it. None with on-demand: the node group creates its own.
    placement_group_name: str | None = None
    system_instance_type: str = "m6i.xlarge"
    system_nodes: int = 2
    fsx_storage_gib: int = 1200
    fsx_throughput_per_tib: FsxThroughputPerTib = field(default=1000, metadata={"choices_note": "MB/s/TiB"})
    fsx_export_bucket: bool = False
    # "destroy" is the one way `cdk destroy` deletes the checkpoints
    fsx_removal_policy: FsxRemovalPolicy = field(
        default="retain", metadata={"choices_note": "(CloudFormation cannot snapshot an FSx file system)"})
    fsx_backup_retention_days: int = 7  # 0: no automatic backups
    fsx_backup_start_time: str = "03:00"  # UTC
    # A dataset imported from S3 (s3://bucket/prefix) into the file system at fsx_import_fsx_path: a data
    # repository association that lists the objects on creation and keeps up with new, changed and deleted
    # ones (auto-import); their content is loaded on first read. None: no import.
    fsx_import_s3_path: str | None = None
    fsx_import_fsx_path: str = "/datasets"
    # A Prometheus server in the cluster that scrapes the training pods' metrics (infra.metrics_collection).
    prometheus_server: bool = False
    # How long VPC flow logs, EKS control-plane logs (audit included) and the Lambda handlers' logs are kept.
    log_retention_days: LogRetentionDays = field(default=90,
                                                  metadata={"choices_note": "days (what CloudWatch Logs takes)"})
    api_allowed_cidrs: tuple[str, ...] = ("0.0.0.0/0",)
    admin_role_arn: str | None = None
    image_uri: str | None = None  # None: build training/Dockerfile as an ECR image asset

    # CDK context key for each field, e.g. gpu_nodes_min -> gpuNodesMin.
    @staticmethod
    def context_key(field_name: str) -> str:
        head, *rest = field_name.split("_")
        return head + "".join(part.capitalize() for part in rest)

    @property
    def instance(self) -> InstanceFacts:
        return instance_facts(self.gpu_instance_type)

    @property
    def spare_nodes(self) -> int:
        """Standby nodes, each running a pod whose ft_launcher takes a lost node's place in the next
        rendezvous round instead of waiting minutes for a replacement node to boot."""
        if self.gpu_nodes_spare is not None:
            return self.gpu_nodes_spare
        if self.gpu_nodes_desired == 0:  # a capacity-block group waiting for its block: nothing runs
            return 0
        return 1 if self.gpu_nodes_desired + 1 <= self.gpu_nodes_max else 0

    @property
    def gpu_nodes_running(self) -> int:
        """The GPU node group's desired size: the training nodes and their spares."""
        return self.gpu_nodes_desired + self.spare_nodes

    @property
    def uses_reserved_capacity(self) -> bool:
        return self.capacity_type != "on-demand"

    def __post_init__(self) -> None:
        _validate(self)

    @classmethod
    def from_context(cls, lookup: Callable[[str], Any] | Mapping[str, Any]) -> "PlatformConfig":
        """Build from CDK context: `lookup` is `node.try_get_context` or a plain mapping.

        Values given with `-c key=value` arrive as strings; they are converted to the field's type.
        Unknown keys in a mapping are rejected (a typo must not silently fall back to a default).
        """
        if isinstance(lookup, Mapping):
            known = {cls.context_key(f.name) for f in fields(cls)}
            unknown = sorted(set(lookup) - known)
            if unknown:
                raise ConfigError(f"unknown config key(s) {unknown}; allowed: {sorted(known)}")
            mapping = lookup
            lookup = mapping.get
        hints = get_type_hints(cls)
        values: dict[str, Any] = {}
        for f in fields(cls):
            key = cls.context_key(f.name)
            raw = lookup(key)
            if raw is not None:
                values[f.name] = _coerce(key, raw, _value_type(hints[f.name]))
        return cls(**values)

    @classmethod
    def from_cdk_context(cls, context: Mapping[str, Any]) -> "PlatformConfig":
        """Build from the whole CDK context (`app.node.get_all_context()`), rejecting camelCase keys that
        are not config keys (`-c gpuNodeMin=3` must not synthesize with the default). CDK's own keys
        (`aws:cdk:…`, `aws-cdk:…`, `@aws-cdk/…`, lookups such as `availability-zones:…`) pass by."""
        return cls.from_context({k: v for k, v in context.items() if _CAMEL_CASE.match(k)})

    def to_context(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            out[self.context_key(f.name)] = list(value) if isinstance(value, tuple) else value
        return out


def _value_type(hint: Any) -> type:
    """The type of a field's set value: `int | None` -> int, `tuple[str, ...]` -> tuple, `Literal[125, 250]` -> int."""
    args = get_args(hint)
    if type(None) in args:
        (hint,) = [a for a in args if a is not type(None)]
    if get_origin(hint) is Literal:
        return type(get_args(hint)[0])
    return get_origin(hint) or hint


def _coerce(key: str, raw: Any, kind: type) -> Any:
    """Convert a context value (JSON from cdk.json, or a string from `-c`) to the field's type."""
    if kind is bool:
        if isinstance(raw, bool):
            return raw
        if str(raw).lower() in ("true", "false"):
            return str(raw).lower() == "true"
        raise ConfigError(f"{key}={raw!r}: expected true or false")
    if kind is int:
        if isinstance(raw, bool) or not (isinstance(raw, int) or re.fullmatch(r"-?\d+", str(raw))):
            raise ConfigError(f"{key}={raw!r}: expected a whole number")
        return int(raw)
    if kind is tuple:
        if isinstance(raw, str):
            raw = json.loads(raw) if raw.strip().startswith("[") else [p.strip() for p in raw.split(",") if p.strip()]
        if not isinstance(raw, (list, tuple)) or not all(isinstance(v, str) for v in raw):
            raise ConfigError(f"{key}={raw!r}: expected a list of strings (JSON list or comma-separated)")
        return tuple(raw)
    if not isinstance(raw, str):
        raise ConfigError(f"{key}={raw!r}: expected a string")
    return raw


def _check_choices(c: PlatformConfig) -> None:
    """Refuse a value outside its field's Literal type, naming the key, the value and the allowed values."""
    hints = get_type_hints(PlatformConfig)
    for f in fields(c):
        allowed, value = get_args(hints[f.name]), getattr(c, f.name)
        if get_origin(hints[f.name]) is Literal and value not in allowed:
            note = f" {f.metadata['choices_note']}" if "choices_note" in f.metadata else ""
            raise ConfigError(f"{c.context_key(f.name)}={value!r} is not allowed: one of {list(allowed)}{note}")


def _validate(c: PlatformConfig) -> None:
    def fail(key: str, value: Any, allowed: str) -> None:
        raise ConfigError(f"{PlatformConfig.context_key(key)}={value!r} is not allowed: {allowed}")

    _check_choices(c)
    if not _NAME.match(c.cluster_name):
        fail("cluster_name", c.cluster_name, "lower-case letters, digits and '-', starting with a letter, at most 63")
    if c.account is not None and not _ACCOUNT.match(c.account):
        fail("account", c.account, "a 12-digit AWS account id, or leave it unset")
    if not _REGION.match(c.region):
        fail("region", c.region, "an AWS region name such as us-east-1")
    if len(c.availability_zones) < 2 or len(set(c.availability_zones)) != len(c.availability_zones):
        fail("availability_zones", list(c.availability_zones), "at least two distinct zones (the EKS control plane needs two)")
    for zone in c.availability_zones:
        if not zone.startswith(c.region) or not re.fullmatch(r"[a-z]", zone[len(c.region):]):
            fail("availability_zones", list(c.availability_zones), f"zones of region {c.region}, such as {c.region}a")
    if c.gpu_availability_zone not in c.availability_zones:
        fail("gpu_availability_zone", c.gpu_availability_zone, f"one of availabilityZones {list(c.availability_zones)}")
    if c.gpu_nodes_max < 1:
        fail("gpu_nodes_max", c.gpu_nodes_max, "at least 1 (a GPU node group of zero nodes trains nothing)")
    # A capacity-block group is created (and upgraded) at 0 nodes before its block is active (EKS user
    # guide, "Create a managed node group with Capacity Blocks for ML"); other groups train from the start.
    lowest = 0 if c.capacity_type == "capacity-block" else 1
    for key in ("gpu_nodes_min", "gpu_nodes_desired"):
        if getattr(c, key) < lowest:
            fail(key, getattr(c, key), "at least 1 (0 only with capacityType=capacity-block, whose group "
                                       "waits at 0 nodes for its block)")
    if not c.gpu_nodes_min <= c.gpu_nodes_desired <= c.gpu_nodes_max:
        raise ConfigError(
            f"GPU node counts must satisfy gpuNodesMin <= gpuNodesDesired <= gpuNodesMax; got "
            f"gpuNodesMin={c.gpu_nodes_min}, gpuNodesDesired={c.gpu_nodes_desired}, gpuNodesMax={c.gpu_nodes_max}"
        )
    if c.gpu_nodes_spare is not None and c.gpu_nodes_spare < 0:
        fail("gpu_nodes_spare", c.gpu_nodes_spare,
             "0 or more hot spare nodes, or leave it unset (1 where gpuNodesMax allows)")
    if c.gpu_nodes_desired == 0 and c.spare_nodes:
        fail("gpu_nodes_spare", c.gpu_nodes_spare, "0 while gpuNodesDesired=0 (no node runs before the block is active)")
    if c.gpu_nodes_running > c.gpu_nodes_max:
        raise ConfigError(
            f"gpuNodesSpare={c.gpu_nodes_spare} does not fit: gpuNodesDesired + gpuNodesSpare = {c.gpu_nodes_running} "
            f"exceeds gpuNodesMax={c.gpu_nodes_max} (the node group runs both); allowed: at most "
            f"{c.gpu_nodes_max - c.gpu_nodes_desired}"
        )
    if c.uses_reserved_capacity:
        if c.capacity_reservation_id is None or not _RESERVATION_ID.match(c.capacity_reservation_id):
            fail("capacity_reservation_id", c.capacity_reservation_id,
                 f"with capacityType={c.capacity_type}: a reservation id like cr-0123456789abcdef0")
    elif c.capacity_reservation_id is not None:
        fail("capacity_reservation_id", c.capacity_reservation_id,
             "only with capacityType capacity-reservation or capacity-block")
    if c.placement_group_name is not None:
        if c.capacity_type != "capacity-reservation":
            fail("placement_group_name", c.placement_group_name,
                 "only with capacityType=capacity-reservation (on-demand nodes get a placement group of their own; "
                 "EC2 places a capacity block itself)")
        if not _PLACEMENT_GROUP.match(c.placement_group_name):
            fail("placement_group_name", c.placement_group_name, "a placement group name: letters, digits and ._+=@,:- "
                                                                 "up to 255 characters")
    if c.system_nodes < 1:
        fail("system_nodes", c.system_nodes, "at least 1 (add-ons need a node)")
    if not (c.fsx_storage_gib == 1200 or (c.fsx_storage_gib > 0 and c.fsx_storage_gib % 2400 == 0)):
        fail("fsx_storage_gib", c.fsx_storage_gib, "1200 or a multiple of 2400 GiB (FSx for Lustre PERSISTENT_2)")
    if not 0 <= c.fsx_backup_retention_days <= FSX_MAX_BACKUP_RETENTION_DAYS:
        fail("fsx_backup_retention_days", c.fsx_backup_retention_days,
             f"0 to {FSX_MAX_BACKUP_RETENTION_DAYS} days (0 turns automatic backups off)")
    if c.fsx_export_bucket and c.fsx_backup_retention_days:
        fail("fsx_backup_retention_days", c.fsx_backup_retention_days,
             "0 with fsxExportBucket=true: FSx for Lustre takes no backups of a file system linked to S3 "
             "(the retained export bucket holds the copy)")
    if c.fsx_import_s3_path is not None:
        if not _S3_PATH.match(c.fsx_import_s3_path) or ".." in c.fsx_import_s3_path:
            fail("fsx_import_s3_path", c.fsx_import_s3_path, "an S3 path s3://bucket/prefix (bucket name rules: "
                 "lower-case letters, digits, '.' and '-'), or leave it unset")
        if c.fsx_export_bucket:
            fail("fsx_import_s3_path", c.fsx_import_s3_path, "unset with fsxExportBucket=true: its association "
                 "covers the whole file system (/), and FSx associations cannot overlap")
        if c.fsx_backup_retention_days:
            fail("fsx_backup_retention_days", c.fsx_backup_retention_days,
                 "0 with fsxImportS3Path set: FSx for Lustre takes no backups of a file system linked to S3")
    if not _FSX_PATH.match(c.fsx_import_fsx_path) or ".." in c.fsx_import_fsx_path.split("/"):
        fail("fsx_import_fsx_path", c.fsx_import_fsx_path,
             "an absolute directory of the file system other than /, such as /datasets")
    if not _DAILY_TIME.match(c.fsx_backup_start_time):
        fail("fsx_backup_start_time", c.fsx_backup_start_time, "a daily UTC time HH:MM from 00:00 to 23:59, e.g. 03:00")
    if not c.api_allowed_cidrs:
        fail("api_allowed_cidrs", [], "at least one CIDR such as 203.0.113.0/24")
    for cidr in c.api_allowed_cidrs:
        try:
            network = ipaddress.ip_network(cidr, strict=True)
        except ValueError:
            fail("api_allowed_cidrs", cidr, "IPv4 CIDRs such as 203.0.113.0/24 (host bits zero)")
        if network.version != 4:
            fail("api_allowed_cidrs", cidr, "IPv4 CIDRs (the EKS public endpoint takes IPv4)")
    if c.account is not None and c.admin_role_arn is None:
        fail("admin_role_arn", None, f"an IAM role ARN with account={c.account}: CloudFormation's execution role "
                                     "creates the cluster, so without an access entry for your role `kubectl` gets "
                                     "Unauthorized (e.g. -c adminRoleArn=arn:aws:iam::<account>:role/Admin)")
    if c.admin_role_arn is not None and not _ROLE_ARN.match(c.admin_role_arn):
        fail("admin_role_arn", c.admin_role_arn, "an IAM role ARN like arn:aws:iam::123456789012:role/Admin")
    if c.image_uri is not None and not _IMAGE_URI.match(c.image_uri):
        fail("image_uri", c.image_uri, "a full image reference with a tag or digest, e.g. 123456789012.dkr.ecr.us-east-1.amazonaws.com/train:1.0")
