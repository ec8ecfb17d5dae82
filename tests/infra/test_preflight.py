"""`python -m infra.preflight`: the AWS account checked against the config before `cdk deploy`, offline with
botocore's Stubber (no network, dummy credentials): one all-pass run, each kind of failure with its fix, and
the command's exit codes."""
from __future__ import annotations

import datetime
from typing import Any

import boto3
import pytest
from botocore.stub import Stubber

import yaml

from infra import preflight
from infra.account_checks import AwsClients, charts_for
from infra.addon_pins import ADDON_PINS
from infra.chart_pins import EFA_DEVICE_PLUGIN, NVIDIA_DEVICE_PLUGIN, ChartSpec
from infra.config import PlatformConfig

ACCOUNT = "123456789012"
ADMIN = f"arn:aws:iam::{ACCOUNT}:role/Admin"
IMAGE = f"{ACCOUNT}.dkr.ecr.us-east-1.amazonaws.com/fsdp-train:v1"
RESERVATION = "cr-0123456789abcdef0"
BASE = {"account": ACCOUNT, "adminRoleArn": ADMIN, "imageUri": IMAGE}  # p5.48xlarge, 2 nodes + 1 spare


def _config(**context: Any) -> PlatformConfig:
    return PlatformConfig.from_context({**BASE, **context})


def _chart_index(spec: ChartSpec, *versions: str) -> bytes:
    """A Helm repository's index.yaml listing `versions` of `spec`'s chart beside another chart."""
    return yaml.safe_dump({"apiVersion": "v1", "entries": {
        spec.chart: [{"name": spec.chart, "version": v} for v in versions],
        "other-chart": [{"name": "other-chart", "version": spec.version}]}}).encode()


class StubbedAws:
    """AwsClients whose clients answer from queued responses, and whose HTTPS GET serves queued chart
    indexes; any call or URL not queued fails the test."""

    SERVICES = ("sts", "ec2", "service-quotas", "eks", "iam", "fsx", "ecr")

    def __init__(self) -> None:
        session = boto3.Session(aws_access_key_id="testing", aws_secret_access_key="testing", region_name="us-east-1")
        self.clients = {name: session.client(name, region_name="us-east-1") for name in self.SERVICES}
        self.stubs = {name: Stubber(client) for name, client in self.clients.items()}
        self.pages: dict[str, bytes | OSError] = {}  # URL -> body, or the error the GET raises
        self.fetched: list[str] = []
        c = self.clients
        self.aws = AwsClients(sts=c["sts"], ec2=c["ec2"], service_quotas=c["service-quotas"], eks=c["eks"],
                              iam=c["iam"], fsx=c["fsx"], ecr=lambda region: c["ecr"], http_get=self._get)

    def _get(self, url: str) -> bytes:
        self.fetched.append(url)
        page = self.pages[url]
        if isinstance(page, OSError):
            raise page
        return page

    def queue(self, config: PlatformConfig, **overrides: Any) -> None:
        """The answers of an account where every check passes, in call order, but those in `overrides`:
        key "service.method" (or "addon:NAME"), value a response dict or ("ErrorCode", "message"); or key
        "chart:RELEASE", value the index's bytes or the OSError its GET raises."""
        for spec in charts_for(config):
            self.pages[spec.index_url] = overrides.get(f"chart:{spec.release}",
                                                       _chart_index(spec, "9.9.9", spec.version))
        for key, service, method, response, params in _passing_calls(config):
            answer = overrides.get(key, response)
            if isinstance(answer, tuple):
                self.stubs[service].add_client_error(method, service_error_code=answer[0], service_message=answer[1],
                                                     expected_params=params)
            elif answer is not None:
                self.stubs[service].add_response(method, answer, params)

    def __enter__(self) -> AwsClients:
        for stub in self.stubs.values():
            stub.activate()
        return self.aws

    def __exit__(self, *exc: object) -> None:
        for stub in self.stubs.values():
            stub.deactivate()
        if exc[0] is None:
            for stub in self.stubs.values():
                stub.assert_no_pending_responses()
            assert sorted(self.fetched) == sorted(self.pages)


def _instance_types(vcpus: int = 192, cards: int = 32, efa: bool = True, efa_interfaces: int = 32) -> dict:
    return {"InstanceTypes": [{"InstanceType": "p5.48xlarge", "VCpuInfo": {"DefaultVCpus": vcpus}, "NetworkInfo": {
        "MaximumNetworkCards": cards, "EfaSupported": efa, "EfaInfo": {"MaximumEfaInterfaces": efa_interfaces}}}]}


def _quota(value: float, name: str = "Running On-Demand P instances") -> dict:
    return {"Quota": {"ServiceCode": "ec2", "QuotaCode": "L-417A185B", "QuotaName": name, "Value": value}}


def _reservation(**fields: Any) -> dict:
    return {"CapacityReservations": [{
        "CapacityReservationId": RESERVATION, "InstanceType": "p5.48xlarge", "AvailabilityZone": "us-east-1a",
        "TotalInstanceCount": 3, "State": "active", "ReservationType": "default",
        "PlacementGroupArn": f"arn:aws:ec2:us-east-1:{ACCOUNT}:placement-group/efa-group", **fields}]}


def _addon_versions(name: str, *versions: str) -> dict:
    return {"addons": [{"addonName": name, "addonVersions": [{"addonVersion": v} for v in versions]}]}


def _passing_calls(config: PlatformConfig) -> list[tuple[str, str, str, dict, dict | None]]:
    kind, zone = config.gpu_instance_type, config.gpu_availability_zone
    calls = [
        ("sts.get_caller_identity", "sts", "get_caller_identity",
         {"UserId": "AIDAEXAMPLE", "Account": ACCOUNT, "Arn": f"arn:aws:iam::{ACCOUNT}:user/dev"}, {}),
        ("ec2.describe_instance_type_offerings", "ec2", "describe_instance_type_offerings",
         {"InstanceTypeOfferings": [{"InstanceType": kind, "LocationType": "availability-zone", "Location": z}
                                    for z in ("us-east-1a", "us-east-1d")]},
         {"LocationType": "availability-zone", "Filters": [{"Name": "instance-type", "Values": [kind]}]}),
        ("ec2.describe_instance_types", "ec2", "describe_instance_types", _instance_types(), {"InstanceTypes": [kind]}),
    ]
    if config.uses_reserved_capacity:
        calls.append(("ec2.describe_capacity_reservations", "ec2", "describe_capacity_reservations", _reservation(),
                      {"CapacityReservationIds": [RESERVATION]}))
    else:
        calls.append(("service-quotas.get_service_quota", "service-quotas", "get_service_quota", _quota(1152.0),
                      {"ServiceCode": "ec2", "QuotaCode": "L-417A185B"}))
    for name, pins in ADDON_PINS.items():
        calls.append((f"addon:{name}", "eks", "describe_addon_versions",
                      _addon_versions(name, "v9.9.9-eksbuild.1", pins[config.kubernetes_version].version),
                      {"addonName": name, "kubernetesVersion": config.kubernetes_version}))
    if config.admin_role_arn:
        calls.append(("iam.get_role", "iam", "get_role", {"Role": {
            "Path": "/", "RoleName": "Admin", "RoleId": "AROAEXAMPLEEXAMPLE01", "Arn": ADMIN,
            "CreateDate": datetime.datetime(2026, 1, 1)}}, {"RoleName": "Admin"}))
    if config.image_uri and ".dkr.ecr." in config.image_uri:
        calls.append(("ecr.describe_images", "ecr", "describe_images", {"imageDetails": [{"imageTags": ["v1"]}]},
                      {"registryId": ACCOUNT, "repositoryName": "fsdp-train", "imageIds": [{"imageTag": "v1"}]}))
    calls.append(("fsx.describe_file_systems", "fsx", "describe_file_systems", {"FileSystems": []},
                  {"MaxResults": 1}))
    return calls


def _run(config: PlatformConfig, **overrides: Any) -> tuple[bool, list[str]]:
    stubbed, lines = StubbedAws(), []
    stubbed.queue(config, **overrides)
    with stubbed as aws:
        passed = preflight.run(config, aws, out=lines.append)
    return passed, lines


def _failures(lines: list[str]) -> list[str]:
    return [line for line in lines if line.startswith("FAIL ")]


def test_an_account_ready_for_the_default_config_passes_every_check_one_line_each():
    passed, lines = _run(_config())
    assert passed, lines
    names = [line.split(":")[0] for line in lines[:-1]]
    assert names == ["PASS credentials", "PASS GPU instance offering", "PASS GPU instance type facts",
                     "PASS on-demand vCPU quota", *(f"PASS add-on {name}" for name in ADDON_PINS),
                     "PASS chart nvidia-device-plugin", "PASS chart aws-efa-k8s-device-plugin",
                     "PASS admin role", "PASS training image", "PASS FSx for Lustre"]
    assert "Running On-Demand P instances: 1152 vCPUs cover 3 x p5.48xlarge (2 nodes + 1 spares) = 576" in lines[3]
    assert "unverified: no read-only call says PERSISTENT_2 is offered in us-east-1a" in lines[-2]
    assert lines[-1].startswith("preflight: all 15 checks passed")


def test_an_instance_type_not_offered_in_the_gpu_zone_fails_naming_the_zones_that_offer_it():
    passed, lines = _run(_config(gpuAvailabilityZone="us-east-1b"))
    assert not passed
    assert _failures(lines) == ["FAIL GPU instance offering: p5.48xlarge is not offered in us-east-1b; us-east-1 "
                                "offers it in us-east-1a, us-east-1d -- fix: -c gpuAvailabilityZone=us-east-1a (and "
                                "list it in availabilityZones)"]
    assert lines[-1].startswith("preflight: 1 of 15 checks failed (GPU instance offering)")


def test_a_region_without_the_instance_type_fails():
    _, lines = _run(_config(), **{"ec2.describe_instance_type_offerings": {"InstanceTypeOfferings": []}})
    assert _failures(lines) == ["FAIL GPU instance offering: us-east-1 offers no p5.48xlarge in any zone -- fix: choose "
                                "another region (-c region=… -c availabilityZones=…) or -c gpuInstanceType=…"]


@pytest.mark.parametrize(("answer", "problem"), [
    (_instance_types(efa_interfaces=16), "at most 16 EFA interfaces, the launch template attaches 32"),
    (_instance_types(efa=False), "no EFA support"),
    (_instance_types(cards=16), "16 network cards, the table says 32"),
    (_instance_types(vcpus=96), "96 vCPUs, the table says 192"),
])
def test_instance_facts_that_disagree_with_ec2_fail(answer, problem):
    _, lines = _run(_config(), **{"ec2.describe_instance_types": answer})
    assert _failures(lines) == [f"FAIL GPU instance type facts: p5.48xlarge: {problem} -- fix: correct p5.48xlarge in "
                                "infra/instances.py"]


def test_a_vcpu_quota_below_nodes_and_spares_fails_with_the_increase_request():
    _, lines = _run(_config(), **{"service-quotas.get_service_quota": _quota(384.0)})
    assert _failures(lines) == [
        "FAIL on-demand vCPU quota: Running On-Demand P instances (L-417A185B) is 384 vCPUs in us-east-1; 3 x "
        "p5.48xlarge (2 nodes + 1 spares) need 576 -- fix: aws service-quotas request-service-quota-increase "
        "--service-code ec2 --quota-code L-417A185B --desired-value 576 --region us-east-1; or use a capacity "
        "reservation"]


def test_a_quota_never_changed_is_read_from_its_default():
    stubbed, lines = StubbedAws(), []
    config = _config()
    stubbed.queue(config, **{"service-quotas.get_service_quota": ("NoSuchResourceException", "no applied value")})
    # the default comes after the applied value's miss, on the same client
    stubbed.stubs["service-quotas"].add_response("get_aws_default_service_quota", _quota(0.0),
                                                 {"ServiceCode": "ec2", "QuotaCode": "L-417A185B"})
    with stubbed as aws:
        assert not preflight.run(config, aws, out=lines.append)
    assert [f.split(" -- ")[0] for f in _failures(lines)] == [
        "FAIL on-demand vCPU quota: Running On-Demand P instances (L-417A185B) is 0 vCPUs in us-east-1; 3 x "
        "p5.48xlarge (2 nodes + 1 spares) need 576"]


def test_a_quota_code_that_names_another_quota_fails_rather_than_counting_it():
    _, lines = _run(_config(), **{"service-quotas.get_service_quota": _quota(9999.0, name="Running Dedicated p5 Hosts")})
    assert _failures(lines) == ["FAIL on-demand vCPU quota: quota L-417A185B is 'Running Dedicated p5 Hosts' here, not "
                                "'Running On-Demand P instances' -- fix: correct the quota code for p5.48xlarge in "
                                "infra/instances.py"]


RESERVED = {"capacityType": "capacity-reservation", "capacityReservationId": RESERVATION,
            "placementGroupName": "efa-group"}


def test_a_matching_capacity_reservation_passes_instead_of_the_quota():
    passed, lines = _run(_config(**RESERVED))
    assert passed, lines
    assert (f"PASS capacity reservation: {RESERVATION}: active default, 3 x p5.48xlarge in us-east-1a, placement group "
            "efa-group") in lines
    assert not [line for line in lines if "vCPU quota" in line]


@pytest.mark.parametrize(("fields", "problem", "fix"), [
    ({"State": "expired"}, "state expired (need active, or scheduled for a block)",
     "use an active or scheduled reservation"),
    ({"InstanceType": "p5en.48xlarge"}, "instance type p5en.48xlarge, the config has p5.48xlarge",
     "-c gpuInstanceType=p5en.48xlarge"),
    ({"AvailabilityZone": "us-east-1d"}, "zone us-east-1d, the config has us-east-1a", "-c gpuAvailabilityZone=us-east-1d"),
    ({"TotalInstanceCount": 2}, "2 instances, the node group runs 3 (nodes + spares)",
     "fewer nodes (-c gpuNodesDesired, gpuNodesSpare) or a larger reservation"),
    ({"PlacementGroupArn": f"arn:aws:ec2:us-east-1:{ACCOUNT}:placement-group/other"},
     "its placement group is other, placementGroupName is efa-group: its instances must launch into its group",
     "-c placementGroupName=other"),
    ({"ReservationType": "capacity-block"}, "it is a capacity-block reservation, not default",
     "-c capacityType= the reservation's kind"),
])
def test_a_reservation_that_does_not_match_the_config_fails_naming_what_differs(fields, problem, fix):
    _, lines = _run(_config(**RESERVED), **{"ec2.describe_capacity_reservations": _reservation(**fields)})
    assert _failures(lines) == [f"FAIL capacity reservation: {RESERVATION}: {problem} -- fix: {fix}"]


def test_a_scheduled_capacity_block_for_a_group_waiting_at_zero_nodes_counts_gpu_nodes_max():
    block = {"capacityType": "capacity-block", "capacityReservationId": RESERVATION, "gpuNodesMin": 0,
             "gpuNodesDesired": 0, "gpuNodesMax": 4}
    passed, lines = _run(_config(**block), **{"ec2.describe_capacity_reservations": _reservation(
        ReservationType="capacity-block", State="scheduled", TotalInstanceCount=4, PlacementGroupArn="")})
    assert passed, lines
    _, lines = _run(_config(**block), **{"ec2.describe_capacity_reservations": _reservation(
        ReservationType="capacity-block", State="scheduled", TotalInstanceCount=2)})
    assert "2 instances, the node group runs 4 (nodes + spares)" in _failures(lines)[0]


def test_a_reservation_that_does_not_exist_fails():
    _, lines = _run(_config(**RESERVED), **{"ec2.describe_capacity_reservations": (
        "InvalidCapacityReservationId.NotFound", "not found")})
    assert _failures(lines) == [f"FAIL capacity reservation: {RESERVATION} does not exist in us-east-1 for this account "
                                "-- fix: -c capacityReservationId=<an id from `aws ec2 describe-capacity-reservations`>"]


def test_an_addon_pin_not_offered_for_the_kubernetes_version_fails_listing_what_is():
    _, lines = _run(_config(kubernetesVersion="1.33"), **{"addon:aws-fsx-csi-driver": _addon_versions(
        "aws-fsx-csi-driver", "v1.8.0-eksbuild.1", "v1.7.1-eksbuild.2")})
    pin = ADDON_PINS["aws-fsx-csi-driver"]["1.33"].version
    assert _failures(lines) == [f"FAIL add-on aws-fsx-csi-driver: {pin} is not offered for Kubernetes 1.33 in us-east-1 "
                                "(offered: v1.8.0-eksbuild.1, v1.7.1-eksbuild.2) -- fix: pin an offered version for "
                                "aws-fsx-csi-driver in infra/addon_pins.py"]


def test_a_chart_version_its_repository_does_not_list_fails_naming_what_it_lists():
    _, lines = _run(_config(), **{"chart:aws-efa-k8s-device-plugin": _chart_index(
        EFA_DEVICE_PLUGIN, "v0.5.31", "v0.5.29")})
    assert _failures(lines) == [
        f"FAIL chart aws-efa-k8s-device-plugin: aws-efa-k8s-device-plugin {EFA_DEVICE_PLUGIN.version} is not listed in "
        "https://aws.github.io/eks-charts/index.yaml (listed first: v0.5.31, v0.5.29) -- fix: pin a listed version "
        "of aws-efa-k8s-device-plugin in infra/chart_pins.py"]


def test_an_unreachable_chart_repository_fails_its_check_only():
    _, lines = _run(_config(), **{"chart:nvidia-device-plugin": OSError("Name or service not known")})
    assert _failures(lines) == [
        "FAIL chart nvidia-device-plugin: https://nvidia.github.io/k8s-device-plugin/index.yaml could not be read "
        "(OSError: Name or service not known) -- fix: check network access to "
        "https://nvidia.github.io/k8s-device-plugin and retry"]


def test_the_charts_checked_follow_the_config():
    assert charts_for(_config()) == [NVIDIA_DEVICE_PLUGIN, EFA_DEVICE_PLUGIN]  # p5: EFA
    assert [c.release for c in charts_for(_config(gpuInstanceType="g6.xlarge", prometheusServer=True))] == [
        "nvidia-device-plugin", "prometheus"]


def test_a_missing_or_unset_admin_role_fails():
    _, lines = _run(_config(), **{"iam.get_role": ("NoSuchEntity", "The role with name Admin cannot be found.")})
    assert _failures(lines) == ["FAIL admin role: role Admin does not exist in this account -- fix: create it, or "
                                "-c adminRoleArn=<an existing role>"]
    _, lines = _run(PlatformConfig.from_context({"imageUri": IMAGE}))
    assert _failures(lines) == ["FAIL admin role: adminRoleArn is not set: the cluster gets no access entry for you and "
                                "kubectl answers Unauthorized -- fix: -c adminRoleArn=arn:aws:iam::ACCOUNT:role/NAME"]


def test_an_image_uri_that_is_not_in_ecr_fails():
    _, lines = _run(_config(), **{"ecr.describe_images": ("ImageNotFoundException", "no such tag")})
    assert _failures(lines) == [f"FAIL training image: {IMAGE}: ImageNotFoundException -- fix: push the image "
                                "(training/Dockerfile), or leave imageUri unset to build it as an asset"]


def test_an_image_outside_ecr_is_not_checked_and_no_image_uri_means_no_image_check():
    passed, lines = _run(_config(imageUri="nvcr.io/nvidia/pytorch:25.10-py3"))
    assert passed and "PASS training image: nvcr.io/nvidia/pytorch:25.10-py3 is not in ECR: not checked" in lines[-3]
    passed, lines = _run(PlatformConfig.from_context({"account": ACCOUNT, "adminRoleArn": ADMIN}))
    assert passed and not [line for line in lines if "training image" in line]


def test_credentials_of_another_account_fail():
    _, lines = _run(_config(account="210987654321"))
    assert _failures(lines) == [f"FAIL credentials: the credentials are account {ACCOUNT}'s (arn:aws:iam::{ACCOUNT}:"
                                "user/dev), the config deploys to account 210987654321 -- fix: use credentials of "
                                f"account 210987654321 (AWS_PROFILE=…), or -c account={ACCOUNT}"]


def test_a_denied_call_fails_its_check_naming_the_call_to_allow():
    _, lines = _run(_config(), **{"fsx.describe_file_systems": ("AccessDeniedException", "not authorized")})
    assert _failures(lines) == ["FAIL FSx for Lustre: DescribeFileSystems failed: AccessDeniedException: not authorized "
                                "-- fix: allow the caller the read-only call DescribeFileSystems"]


class TestCommand:
    """`python -m infra.preflight`'s exit codes: 0 passed, 1 a check failed, 2 usage, config or credentials."""

    @staticmethod
    def _main(argv: list[str], **overrides: Any) -> tuple[int, StubbedAws]:
        stubbed = StubbedAws()
        config = preflight.read_config(argv[1::2])
        stubbed.queue(config, **overrides)
        with stubbed:
            return preflight.main(argv, make_clients=lambda session, region: stubbed.aws), stubbed

    ARGS = ["-c", f"account={ACCOUNT}", "-c", f"adminRoleArn={ADMIN}", "-c", "gpuNodesDesired=3"]

    def test_the_same_context_keys_as_cdk_and_exit_0_when_all_pass(self, capsys):
        rc, _ = self._main(self.ARGS, **{"service-quotas.get_service_quota": _quota(768.0)})
        out = capsys.readouterr().out
        assert rc == 0, out
        assert "cover 4 x p5.48xlarge (3 nodes + 1 spares) = 768" in out  # -c gpuNodesDesired=3 arrived

    def test_exit_1_on_a_failed_check(self, capsys):
        rc, _ = self._main(self.ARGS, **{"service-quotas.get_service_quota": _quota(192.0)})
        assert rc == 1
        assert "FAIL on-demand vCPU quota" in capsys.readouterr().out

    @pytest.mark.parametrize(("argv", "message"), [
        (["-c", "gpuNodeMin=3"], "preflight: unknown config key(s) ['gpuNodeMin']"),
        (["-c", "gpuInstanceType=p9.xlarge"], "preflight: gpuInstanceType='p9.xlarge' is not allowed"),
        (["-c", "oops"], "preflight: -c 'oops': expected key=value"),
        (["--no-such-flag"], "preflight: unrecognized arguments: --no-such-flag"),
    ])
    def test_exit_2_with_one_line_on_bad_usage_or_config(self, capsys, argv, message):
        assert preflight.main(argv, make_clients=lambda session, region: pytest.fail("no AWS call")) == 2
        err = capsys.readouterr().err
        assert err.startswith(message) and err.count("\n") == 1

    def test_exit_2_saying_how_to_give_credentials_when_aws_rejects_them(self, capsys):
        stubbed = StubbedAws()  # the run stops at the first call: nothing else is asked
        stubbed.stubs["sts"].add_client_error("get_caller_identity", service_error_code="ExpiredToken",
                                              service_message="The security token expired")
        with stubbed:
            assert preflight.main(self.ARGS, make_clients=lambda session, region: stubbed.aws) == 2
        err = capsys.readouterr().err
        assert err.startswith("preflight: no usable AWS credentials (CredentialsError: GetCallerIdentity: ExpiredToken")
        assert "AWS_PROFILE=NAME" in err and err.count("\n") == 1

    def test_exit_2_without_any_credentials(self, capsys, monkeypatch):
        for var in ("AWS_PROFILE", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
            monkeypatch.delenv(var, raising=False)
        monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
        monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
        monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
        assert preflight.main(["-c", f"adminRoleArn={ADMIN}"]) == 2
        assert "no usable AWS credentials (NoCredentialsError" in capsys.readouterr().err
