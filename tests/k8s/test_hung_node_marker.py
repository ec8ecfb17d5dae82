"""The hung-node marker (k8s/mark_hung_nodes.py, k8s/charts/hung_nodes.py): a GPU node whose kubelet has been
silent for the threshold is fenced (its instance stopped) and then marked out of service, so that PodGC deletes
its pod and the Job replaces it; its rights are listing and patching nodes, and (infra/node_fencing.py)
stopping this cluster's GPU instances."""
from __future__ import annotations

from datetime import datetime, timedelta, timezone

from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials

from infra.config import GPU_NODE_LABEL, GPU_TAINT_KEY, HUNG_NODE_MARKER_SERVICE_ACCOUNT, NAMESPACE, SYSTEM_NODE_LABEL
from k8s.mark_hung_nodes import (OUT_OF_SERVICE, TAINT, instance_state, poll, sigv4_headers, silent_for_s,
                                 taint_patch, to_mark, to_unmark)

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=timezone.utc)
GPU_TAINT = {"key": GPU_TAINT_KEY, "value": "true", "effect": "NoSchedule"}


def _node(name: str, ready: str, since_s: float, taints: list[dict] | None = None) -> dict:
    changed = (NOW - timedelta(seconds=since_s)).isoformat().replace("+00:00", "Z")
    return {"metadata": {"name": name, "resourceVersion": "42"},
            "spec": {"taints": [GPU_TAINT, *(taints or [])], "providerID": f"aws:///us-east-1a/i-{name}"},
            "status": {"conditions": [{"type": "MemoryPressure", "status": "False", "lastTransitionTime": changed},
                                      {"type": "Ready", "status": ready, "lastTransitionTime": changed}]}}


def test_only_a_node_silent_past_the_threshold_is_marked_once():
    nodes = [_node("hung", "Unknown", 61), _node("just-silent", "Unknown", 59),
             _node("reports-not-ready", "False", 600),  # its kubelet reports: it can stop its own pods
             _node("healthy", "True", 600), _node("marked", "Unknown", 600, [TAINT])]
    assert to_mark(nodes, NOW, threshold_s=60) == ["hung"]
    assert silent_for_s(nodes[0], NOW) == 61 and silent_for_s(nodes[3], NOW) is None


def test_a_marked_node_that_reports_ready_again_is_unmarked_and_nobody_elses_taint_is_touched():
    someone_elses = {"key": OUT_OF_SERVICE, "value": "nodeshutdown", "effect": "NoExecute"}  # an operator's
    nodes = [_node("back", "True", 5, [TAINT]), _node("still-hung", "Unknown", 900, [TAINT]),
             _node("operator", "True", 5, [someone_elses])]
    assert to_unmark(nodes) == ["back"]


def test_the_patch_keeps_the_other_taints_and_applies_only_to_the_node_as_read():
    node = _node("hung", "Unknown", 61)
    mark = taint_patch(node, mark=True)
    assert mark == [{"op": "test", "path": "/metadata/resourceVersion", "value": "42"},
                    {"op": "add", "path": "/spec/taints", "value": [GPU_TAINT, TAINT]}]
    node["spec"]["taints"] = mark[1]["value"]
    assert taint_patch(node, mark=False)[1]["value"] == [GPU_TAINT]
    assert TAINT == {"key": "node.kubernetes.io/out-of-service", "value": "hung", "effect": "NoExecute"}


def test_the_marker_runs_on_the_system_nodes_with_node_list_and_patch_rights_only(render):
    r = render("--hung-node-out-of-service", "45")
    marker = [o for o in r.files["hung-node-marker.k8s.yaml"]]
    role, binding = r.one("ClusterRole"), r.one("ClusterRoleBinding")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["list", "patch"]}]
    (deployment,) = [o for o in marker if o["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": pod["serviceAccountName"], "namespace": NAMESPACE}]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                  "name": role["metadata"]["name"]}
    assert pod["nodeSelector"] == {SYSTEM_NODE_LABEL: "true"}  # never on a GPU node it may mark
    python, flag, script, threshold, selector, region = pod["containers"][0]["command"]
    assert (python, flag, threshold, selector, region) == ("python", "-c", "45", f"{GPU_NODE_LABEL}=true", "us-east-1")
    compile(script, "mark_hung_nodes.py", "exec")
    # The service account the fencing role's Pod Identity association names (infra/node_fencing.py).
    assert pod["serviceAccountName"] == HUNG_NODE_MARKER_SERVICE_ACCOUNT
    (policy,) = [o for o in marker if o["kind"] == "NetworkPolicy"]
    # The Kubernetes API, DNS, the Pod Identity agent, EC2's API.
    assert not policy["spec"].get("ingress") and [p["port"] for rule in policy["spec"]["egress"]
                                                   for p in rule["ports"]] == [443, 53, 53, 80, 443]


def test_the_marker_is_on_by_default_and_zero_turns_it_off(render, render_error):
    assert render().one("ClusterRole")["metadata"]["name"] == "fsdp-train-hung-node-marker"  # on by default
    assert "hung-node-marker.k8s.yaml" not in render("--hung-node-out-of-service", "0").files
    err = render_error("--hung-node-out-of-service", "1800")
    assert "hung_node_out_of_service_s=1800 is not allowed: 1 to 1799 seconds" in err


class FakeEc2:
    """EC2 as the marker sees it: instance states, and the instances it was asked to stop."""

    def __init__(self, states: dict[str, str]) -> None:
        self.states, self.stopped = states, []

    def state(self, instance: str) -> str:
        return self.states[instance]

    def stop(self, instance: str) -> None:
        self.stopped.append(instance)
        self.states[instance] = "stopping"


def test_a_silent_node_is_marked_only_once_its_instance_is_stopped():
    """Kubernetes' docs: the out-of-service taint only on a node that is shut down. A partitioned node that
    still runs could write to FSx beside its replacement, so the marker stops it first."""
    node, ec2, patches = _node("hung", "Unknown", 61), FakeEc2({"i-hung": "running"}), []

    def patch(name: str, body: list[dict]) -> None:
        patches.append((name, body))

    poll([node], NOW, 60, ec2, patch)
    assert ec2.stopped == ["i-hung"] and patches == []  # fenced first, not marked yet
    poll([node], NOW, 60, ec2, patch)
    assert ec2.stopped == ["i-hung"] and patches == []  # stopping: nothing runs yet, nothing more to do
    ec2.states["i-hung"] = "stopped"
    poll([node], NOW, 60, ec2, patch)
    assert patches == [("hung", taint_patch(node, mark=True))]


def test_a_node_without_an_instance_id_is_never_marked():
    node, ec2, patches = _node("odd", "Unknown", 600), FakeEc2({}), []
    node["spec"]["providerID"] = "kind://docker/odd"
    poll([node], NOW, 60, ec2, lambda name, body: patches.append(name))
    assert patches == [] and ec2.stopped == []


def test_ec2_calls_are_signed_as_botocore_signs_them_and_the_state_is_read_from_the_response():
    """The marker is stdlib-only (the python image has no boto3): its Signature Version 4 must match the
    SDK's for the same request, credentials and time."""
    body = b"Action=StopInstances&Version=2016-11-15&InstanceId.1=i-0123&Force=true"
    content_type = {"Content-Type": "application/x-www-form-urlencoded; charset=utf-8"}
    credentials = {"AccessKeyId": "AKIDEXAMPLE", "SecretAccessKey": "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY",
                   "Token": "session/token+="}
    url = "https://ec2.us-east-1.amazonaws.com/"
    request = AWSRequest(method="POST", url=url, data=body, headers=dict(content_type))
    SigV4Auth(Credentials(credentials["AccessKeyId"], credentials["SecretAccessKey"], credentials["Token"]),
              "ec2", "us-east-1").add_auth(request)
    signed_at = datetime.strptime(request.headers["X-Amz-Date"], "%Y%m%dT%H%M%SZ").replace(tzinfo=timezone.utc)
    ours = sigv4_headers("POST", url, body, content_type, credentials, "us-east-1", "ec2", signed_at)
    assert ours["Authorization"] == request.headers["Authorization"]
    assert ours["X-Amz-Security-Token"] == credentials["Token"]
    response = (b'<DescribeInstancesResponse xmlns="http://ec2.amazonaws.com/doc/2016-11-15/"><reservationSet>'
                b'<item><instancesSet><item><instanceId>i-0123</instanceId><instanceState><code>80</code>'
                b'<name>stopped</name></instanceState></item></instancesSet></item></reservationSet>'
                b'</DescribeInstancesResponse>')
    assert instance_state(response) == "stopped"
