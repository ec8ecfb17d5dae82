"""The AWS preflight's checks: each asks the account one read-only question about the platform config and
answers with a CheckResult (name, ok, detail, fix). `python -m infra.preflight` runs them (infra.preflight).

Only Describe/Get/List calls: STS GetCallerIdentity, EC2 DescribeInstanceTypeOfferings, DescribeInstanceTypes,
DescribeCapacityReservations, Service Quotas GetServiceQuota (GetAWSDefaultServiceQuota where no value was
applied), EKS DescribeAddonVersions, IAM GetRole, ECR DescribeImages, FSx DescribeFileSystems; and an HTTPS GET
of each pinned Helm chart's repository index.
"""
from __future__ import annotations

import functools
import re
import urllib.request
from dataclasses import dataclass
from typing import Any, Callable

import boto3
import yaml
from botocore.config import Config
from botocore.exceptions import (BotoCoreError, ClientError, CredentialRetrievalError, NoCredentialsError,
                                 PartialCredentialsError, SSOTokenLoadError, TokenRetrievalError,
                                 UnauthorizedSSOTokenError)

from infra.addon_pins import ADDON_PINS
from infra.chart_pins import EFA_DEVICE_PLUGIN, NVIDIA_DEVICE_PLUGIN, PROMETHEUS, ChartSpec
from infra.config import PlatformConfig

# Errors that mean the credentials themselves are unusable: the run stops with how to provide them.
CREDENTIAL_ERROR_CODES = frozenset({
    "ExpiredToken", "ExpiredTokenException", "InvalidClientTokenId", "UnrecognizedClientException", "AuthFailure",
    "SignatureDoesNotMatch", "InvalidSignatureException", "RequestExpired",
})
# An ECR image URI: ACCOUNT.dkr.ecr.REGION.amazonaws.com[.cn]/REPOSITORY(:TAG|@sha256:DIGEST).
_ECR_IMAGE = re.compile(r"^(?P<registry>\d{12})\.dkr\.ecr\.(?P<region>[a-z0-9-]+)\.amazonaws\.com(\.cn)?/"
                        r"(?P<repository>[^:@]+)(:(?P<tag>[\w.-]+)|@(?P<digest>sha256:[0-9a-f]{64}))$")


class CredentialsError(Exception):
    """AWS rejected the caller's credentials (expired, unknown, badly signed)."""


# No credentials found, or rejected: the run stops there, not one failed check each.
CREDENTIAL_EXCEPTIONS = (NoCredentialsError, PartialCredentialsError, CredentialRetrievalError, TokenRetrievalError,
                         SSOTokenLoadError, UnauthorizedSSOTokenError, CredentialsError)


@dataclass(frozen=True)
class CheckResult:
    name: str
    ok: bool
    detail: str
    fix: str = ""  # what to do about a failure


def _http_get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=15) as response:
        return response.read()


@dataclass(frozen=True)
class AwsClients:
    """The boto3 clients the checks call, all in the config's region but ECR's (the image's registry region),
    and the HTTPS GET that reads the Helm chart repositories' indexes."""

    sts: Any
    ec2: Any
    service_quotas: Any
    eks: Any
    iam: Any
    fsx: Any
    ecr: Callable[[str], Any]  # region -> ECR client
    http_get: Callable[[str], bytes]  # URL -> body

    @classmethod
    def for_region(cls, session: boto3.Session, region: str) -> "AwsClients":
        # Short timeouts and few retries: the whole preflight stays well under a minute.
        config = Config(connect_timeout=5, read_timeout=15, retries={"max_attempts": 3, "mode": "standard"})

        def client(service: str, in_region: str = region) -> Any:
            return session.client(service, region_name=in_region, config=config)

        return cls(sts=client("sts"), ec2=client("ec2"), service_quotas=client("service-quotas"), eks=client("eks"),
                   iam=client("iam"), fsx=client("fsx"), ecr=lambda in_region: client("ecr", in_region),
                   http_get=_http_get)


Verdict = tuple[bool, str, str]  # ok, detail, fix
Check = Callable[[PlatformConfig, AwsClients], CheckResult]


def _passed(detail: str) -> Verdict:
    return True, detail, ""


def _failed(detail: str, fix: str) -> Verdict:
    return False, detail, fix


def check(name: str) -> Callable[[Callable[[PlatformConfig, AwsClients], Verdict]], Check]:
    """Make a verdict function a named check; an AWS error in it fails the check, naming the call, unless the
    credentials were rejected (CredentialsError: the whole run stops)."""
    def wrap(verdict: Callable[[PlatformConfig, AwsClients], Verdict]) -> Check:
        @functools.wraps(verdict)
        def run(config: PlatformConfig, aws: AwsClients) -> CheckResult:
            try:
                ok, detail, fix = verdict(config, aws)
            except ClientError as e:
                code, message = e.response["Error"].get("Code", "?"), e.response["Error"].get("Message", "")
                if code in CREDENTIAL_ERROR_CODES:
                    raise CredentialsError(f"{e.operation_name}: {code}: {message}") from e
                denied = "AccessDenied" in code or "UnauthorizedOperation" in code
                ok, detail = False, f"{e.operation_name} failed: {code}: {message}"
                fix = (f"allow the caller the read-only call {e.operation_name}" if denied
                       else "retry; if it persists, the message above says what AWS objects to")
            except CREDENTIAL_EXCEPTIONS:
                raise
            except BotoCoreError as e:  # unreachable endpoint, timeout
                ok, detail, fix = False, f"{type(e).__name__}: {e}", "check network access to the AWS API and retry"
            return CheckResult(name, ok, detail, fix)
        return run
    return wrap


@check("credentials")
def caller_account(config: PlatformConfig, aws: AwsClients) -> Verdict:
    identity = aws.sts.get_caller_identity()
    if config.account and identity["Account"] != config.account:
        return _failed(f"the credentials are account {identity['Account']}'s ({identity['Arn']}), the config "
                       f"deploys to account {config.account}",
                       f"use credentials of account {config.account} (AWS_PROFILE=…), or -c account="
                       f"{identity['Account']}")
    return _passed(f"account {identity['Account']} ({identity['Arn']})")


@check("GPU instance offering")
def gpu_offering(config: PlatformConfig, aws: AwsClients) -> Verdict:
    kind, zone = config.gpu_instance_type, config.gpu_availability_zone
    offerings = aws.ec2.describe_instance_type_offerings(
        LocationType="availability-zone", Filters=[{"Name": "instance-type", "Values": [kind]}])
    zones = sorted(o["Location"] for o in offerings["InstanceTypeOfferings"])
    if zone in zones:
        return _passed(f"{kind} is offered in {zone}")
    if not zones:
        return _failed(f"{config.region} offers no {kind} in any zone",
                       "choose another region (-c region=… -c availabilityZones=…) or -c gpuInstanceType=…")
    return _failed(f"{kind} is not offered in {zone}; {config.region} offers it in {', '.join(zones)}",
                   f"-c gpuAvailabilityZone={zones[0]} (and list it in availabilityZones)")


@check("GPU instance type facts")
def gpu_instance_facts(config: PlatformConfig, aws: AwsClients) -> Verdict:
    """infra.instances against DescribeInstanceTypes: vCPUs (the quota check counts them), network cards and
    EFA interfaces (the launch template attaches one EFA interface per card)."""
    facts = config.instance
    [info] = aws.ec2.describe_instance_types(InstanceTypes=[facts.name])["InstanceTypes"]
    network = info["NetworkInfo"]
    problems = []
    if info["VCpuInfo"]["DefaultVCpus"] != facts.vcpus:
        problems.append(f"{info['VCpuInfo']['DefaultVCpus']} vCPUs, the table says {facts.vcpus}")
    if network.get("MaximumNetworkCards") != facts.network_cards:
        problems.append(f"{network.get('MaximumNetworkCards')} network cards, the table says {facts.network_cards}")
    if facts.efa_interfaces:
        efa_interfaces = network.get("EfaInfo", {}).get("MaximumEfaInterfaces", 0)
        if not network.get("EfaSupported"):
            problems.append("no EFA support")
        elif efa_interfaces < facts.efa_interfaces:
            problems.append(f"at most {efa_interfaces} EFA interfaces, the launch template attaches {facts.efa_interfaces}")
    if problems:
        return _failed(f"{facts.name}: {'; '.join(problems)}", f"correct {facts.name} in infra/instances.py")
    efa = f", EFA on {facts.efa_interfaces} interfaces" if facts.efa_interfaces else ""
    return _passed(f"{facts.name}: {facts.vcpus} vCPUs, {facts.network_cards} network cards{efa}")


@check("on-demand vCPU quota")
def on_demand_vcpu_quota(config: PlatformConfig, aws: AwsClients) -> Verdict:
    quota, facts = config.instance.on_demand_vcpu_quota, config.instance
    needed = config.gpu_nodes_running * facts.vcpus
    try:
        applied = aws.service_quotas.get_service_quota(ServiceCode="ec2", QuotaCode=quota.code)["Quota"]
    except aws.service_quotas.exceptions.NoSuchResourceException:  # never changed: the default applies
        applied = aws.service_quotas.get_aws_default_service_quota(ServiceCode="ec2", QuotaCode=quota.code)["Quota"]
    if applied.get("QuotaName") != quota.name:
        return _failed(f"quota {quota.code} is {applied.get('QuotaName')!r} here, not {quota.name!r}",
                       f"correct the quota code for {facts.name} in infra/instances.py")
    value = applied["Value"]
    count = f"{config.gpu_nodes_running} x {facts.name} ({config.gpu_nodes_desired} nodes + {config.spare_nodes} spares)"
    if value < needed:
        return _failed(f"{quota.name} ({quota.code}) is {value:g} vCPUs in {config.region}; {count} need {needed}",
                       f"aws service-quotas request-service-quota-increase --service-code ec2 --quota-code {quota.code} "
                       f"--desired-value {needed} --region {config.region}; or use a capacity reservation")
    return _passed(f"{quota.name}: {value:g} vCPUs cover {count} = {needed} (instances already running count too)")


@check("capacity reservation")
def capacity_reservation(config: PlatformConfig, aws: AwsClients) -> Verdict:
    rid = config.capacity_reservation_id
    try:
        [reservation] = aws.ec2.describe_capacity_reservations(CapacityReservationIds=[rid])["CapacityReservations"]
    except ClientError as e:
        if not e.response["Error"].get("Code", "").startswith("InvalidCapacityReservationId"):
            raise
        return _failed(f"{rid} does not exist in {config.region} for this account",
                       "-c capacityReservationId=<an id from `aws ec2 describe-capacity-reservations`>")
    # A capacity-block group may wait at 0 nodes for its block; it will run up to gpuNodesMax.
    needed = config.gpu_nodes_running or config.gpu_nodes_max
    kind = "capacity-block" if config.capacity_type == "capacity-block" else "default"
    found: list[tuple[str, str]] = []  # (problem, fix)
    if reservation.get("ReservationType", "default") != kind:
        found.append((f"it is a {reservation.get('ReservationType', 'default')} reservation, not {kind}",
                      "-c capacityType= the reservation's kind"))
    if reservation["State"] not in ("active", "scheduled"):
        found.append((f"state {reservation['State']} (need active, or scheduled for a block)",
                      "use an active or scheduled reservation"))
    if reservation["InstanceType"] != config.gpu_instance_type:
        found.append((f"instance type {reservation['InstanceType']}, the config has {config.gpu_instance_type}",
                      f"-c gpuInstanceType={reservation['InstanceType']}"))
    if reservation["AvailabilityZone"] != config.gpu_availability_zone:
        found.append((f"zone {reservation['AvailabilityZone']}, the config has {config.gpu_availability_zone}",
                      f"-c gpuAvailabilityZone={reservation['AvailabilityZone']}"))
    if reservation["TotalInstanceCount"] < needed:
        found.append((f"{reservation['TotalInstanceCount']} instances, the node group runs {needed} (nodes + spares)",
                      "fewer nodes (-c gpuNodesDesired, gpuNodesSpare) or a larger reservation"))
    group = reservation.get("PlacementGroupArn", "").rpartition("/")[2] or None
    if config.capacity_type == "capacity-reservation" and group != config.placement_group_name:
        found.append((f"its placement group is {group}, placementGroupName is {config.placement_group_name}: its "
                      "instances must launch into its group",
                      f"-c placementGroupName={group}" if group else "unset placementGroupName"))
    if found:
        return _failed(f"{rid}: " + "; ".join(p for p, _ in found), "; ".join(f for _, f in found))
    in_group = f", placement group {group}" if group else ""
    return _passed(f"{rid}: {reservation['State']} {kind}, {reservation['TotalInstanceCount']} x "
                   f"{reservation['InstanceType']} in {reservation['AvailabilityZone']}{in_group}")


def addon_version(addon: str) -> Check:
    """The pinned version of `addon` (infra.addon_pins) is offered for the config's Kubernetes version."""
    @check(f"add-on {addon}")
    def offered(config: PlatformConfig, aws: AwsClients) -> Verdict:
        pin = ADDON_PINS[addon][config.kubernetes_version]
        pages = aws.eks.get_paginator("describe_addon_versions").paginate(
            addonName=addon, kubernetesVersion=config.kubernetes_version)
        versions = [v["addonVersion"] for page in pages for info in page["addons"] for v in info["addonVersions"]]
        if pin.version in versions:
            return _passed(f"{pin.version} is offered for Kubernetes {config.kubernetes_version}")
        newest = ", ".join(versions[:3]) or "none"
        return _failed(f"{pin.version} is not offered for Kubernetes {config.kubernetes_version} in {config.region} "
                       f"(offered: {newest})", f"pin an offered version for {addon} in infra/addon_pins.py")
    return offered


def chart_version(spec: ChartSpec) -> Check:
    """The pinned version of `spec` (infra.chart_pins) is listed in its repository's index.yaml, where Helm
    looks a version up (Helm docs, "The Chart Repository Guide": the index lists every version of every
    chart); a version it lacks fails the Helm release and rolls the Cluster stack back."""
    @check(f"chart {spec.release}")
    def listed(config: PlatformConfig, aws: AwsClients) -> Verdict:
        try:
            index = yaml.safe_load(aws.http_get(spec.index_url)) or {}
        except (OSError, yaml.YAMLError) as e:  # urllib's errors are OSErrors
            return _failed(f"{spec.index_url} could not be read ({type(e).__name__}: {e})",
                           f"check network access to {spec.repository} and retry")
        versions = [str(entry.get("version")) for entry in index.get("entries", {}).get(spec.chart, [])]
        if spec.version in versions:
            return _passed(f"{spec.chart} {spec.version} is listed in {spec.repository}")
        newest = ", ".join(versions[:3]) or "none"
        return _failed(f"{spec.chart} {spec.version} is not listed in {spec.index_url} (listed first: {newest})",
                       f"pin a listed version of {spec.chart} in infra/chart_pins.py")
    return listed


def charts_for(config: PlatformConfig) -> list[ChartSpec]:
    """The charts the stacks install for this config (infra.platform)."""
    charts = [NVIDIA_DEVICE_PLUGIN]
    if config.instance.efa_interfaces:
        charts.append(EFA_DEVICE_PLUGIN)
    if config.prometheus_server:
        charts.append(PROMETHEUS)
    return charts


@check("admin role")
def admin_role(config: PlatformConfig, aws: AwsClients) -> Verdict:
    arn = config.admin_role_arn
    if arn is None:
        return _failed("adminRoleArn is not set: the cluster gets no access entry for you and kubectl answers "
                       "Unauthorized", "-c adminRoleArn=arn:aws:iam::ACCOUNT:role/NAME")
    name = arn.rpartition("/")[2]
    try:
        role = aws.iam.get_role(RoleName=name)["Role"]
    except aws.iam.exceptions.NoSuchEntityException:
        return _failed(f"role {name} does not exist in this account", "create it, or -c adminRoleArn=<an existing role>")
    if role["Arn"] != arn:
        return _failed(f"role {name} is {role['Arn']}, not {arn}", f"-c adminRoleArn={role['Arn']}")
    return _passed(f"{arn} exists")


@check("training image")
def training_image(config: PlatformConfig, aws: AwsClients) -> Verdict:
    uri = config.image_uri
    match = _ECR_IMAGE.match(uri)
    if not match:
        return _passed(f"{uri} is not in ECR: not checked (the GPU and system nodes must be able to pull it)")
    image_id = {"imageTag": match["tag"]} if match["tag"] else {"imageDigest": match["digest"]}
    ecr = aws.ecr(match["region"])
    try:
        ecr.describe_images(registryId=match["registry"], repositoryName=match["repository"], imageIds=[image_id])
    except (ecr.exceptions.RepositoryNotFoundException, ecr.exceptions.ImageNotFoundException) as e:
        return _failed(f"{uri}: {e.response['Error']['Code']}",
                       "push the image (training/Dockerfile), or leave imageUri unset to build it as an asset")
    return _passed(f"{uri} exists")


@check("FSx for Lustre")
def fsx_lustre(config: PlatformConfig, aws: AwsClients) -> Verdict:
    """What a read-only call can tell: FSx answers in the region to these credentials. The throughput is one
    PERSISTENT_2 allows (infra.config refuses others: FSx API reference, PerUnitStorageThroughput "For
    PERSISTENT_2 SSD-based deployment types, valid values are 125, 250, 500, and 1000 MB/s/TiB"). No FSx API
    says whether PERSISTENT_2 can be created in a given zone: that stays unverified until `cdk deploy`."""
    aws.fsx.describe_file_systems(MaxResults=1)
    return _passed(f"FSx answers in {config.region}; PERSISTENT_2 at {config.fsx_throughput_per_tib} MB/s/TiB is an "
                   f"allowed value; unverified: no read-only call says PERSISTENT_2 is offered in "
                   f"{config.gpu_availability_zone}")


def checks_for(config: PlatformConfig) -> list[Check]:
    """The checks that apply to this config, in the order they print."""
    checks: list[Check] = [caller_account, gpu_offering, gpu_instance_facts]
    # A reservation's instances were counted against the on-demand quota when it was created (EC2 API
    # reference, CreateCapacityReservation: the request fails if it exceeds the On-Demand Instance limit);
    # whether a capacity block's do is unverified: the reservation check counts them instead.
    checks.append(capacity_reservation if config.uses_reserved_capacity else on_demand_vcpu_quota)
    checks += [addon_version(addon) for addon in ADDON_PINS]
    checks += [chart_version(spec) for spec in charts_for(config)]
    checks.append(admin_role)
    if config.image_uri:
        checks.append(training_image)
    checks.append(fsx_lustre)
    return checks
