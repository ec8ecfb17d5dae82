"""The hung-node marker, run by its Deployment as `python -c <this file> THRESHOLD_S SELECTOR REGION`: a node that
SELECTOR matches and whose kubelet stopped reporting (Ready condition Unknown) for THRESHOLD_S seconds is fenced
(its EC2 instance stopped) and, once EC2 reports the instance stopped, marked out of service; a node that
reports Ready again is unmarked.

Why: a hung node's pod stays Terminating, and the Job (podReplacementPolicy: Failed) replaces it only once it is
Failed, which without this is EKS auto repair's 30 min. On a node with the taint node.kubernetes.io/out-of-service
PodGC force-deletes the terminating pods and marks them Failed, and the Job replaces them uncounted; the taint is
for a node that is shut down, hence the forced stop first (Kubernetes 1.34 docs: "Non-graceful node shutdown
handling" in Node Shutdowns, and "Garbage collection of Pods" in Pod Lifecycle). Cost: stdlib only, a poll every
POLL_S (RBAC: list and patch nodes; IAM: StopInstances on this cluster's GPU instances, DescribeInstances;
infra.node_fencing). The whole sequence: docs/recovery.md, "A node that hangs".
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import ssl
import sys
import time
import urllib.parse
import urllib.request
import xml.etree.ElementTree as ElementTree
from datetime import datetime, timezone
from typing import Callable

API = "https://kubernetes.default.svc"
ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"
OUT_OF_SERVICE = "node.kubernetes.io/out-of-service"
TAINT = {"key": OUT_OF_SERVICE, "value": "hung", "effect": "NoExecute"}  # the value says who set it
POLL_S = 10.0
EC2_API_VERSION = "2016-11-15"
FENCED_STATES = ("stopped", "terminated")  # EC2 instance states in which nothing on the instance runs
STOPPING_STATES = ("stopping", "shutting-down")


def _ready(node: dict) -> dict:
    return next((c for c in node.get("status", {}).get("conditions", []) if c["type"] == "Ready"), {})


def silent_for_s(node: dict, now: datetime) -> float | None:
    """Seconds since the node controller marked the node's Ready condition Unknown (its kubelet stopped
    reporting); None while it reports (Ready True or False: a kubelet that reports can stop its own pods)."""
    ready = _ready(node)
    if ready.get("status") != "Unknown":
        return None
    since = datetime.fromisoformat(ready["lastTransitionTime"].replace("Z", "+00:00"))
    return (now - since).total_seconds()


def _marked(node: dict) -> bool:
    return any(t.get("key") == OUT_OF_SERVICE and t.get("value") == TAINT["value"]
               for t in node.get("spec", {}).get("taints", []))


def to_mark(nodes: list[dict], now: datetime, threshold_s: float) -> list[str]:
    """The nodes silent for threshold_s seconds or more, not marked yet."""
    return [n["metadata"]["name"] for n in nodes
            if not _marked(n) and (silent_for_s(n, now) or 0.0) >= threshold_s > 0]


def to_unmark(nodes: list[dict]) -> list[str]:
    """The nodes this marker marked that report Ready again: schedulable once more."""
    return [n["metadata"]["name"] for n in nodes if _marked(n) and _ready(n).get("status") == "True"]


def taint_patch(node: dict, mark: bool) -> list[dict]:
    """A JSON patch that adds or removes the taint, only if the node did not change since it was read."""
    taints = [t for t in node.get("spec", {}).get("taints", []) if t.get("key") != OUT_OF_SERVICE]
    return [{"op": "test", "path": "/metadata/resourceVersion", "value": node["metadata"]["resourceVersion"]},
            {"op": "add", "path": "/spec/taints", "value": [*taints, TAINT] if mark else taints}]


def instance_id(node: dict) -> str | None:
    """The EC2 instance id in the node's providerID (aws:///<zone>/<instance id>); None on anything else."""
    provider_id = node.get("spec", {}).get("providerID", "")
    candidate = provider_id.rpartition("/")[2]
    return candidate if provider_id.startswith("aws://") and candidate.startswith("i-") else None


def fence_step(state: str) -> str:
    """What to do for a silent node whose instance is in `state`: "mark" it once nothing runs there, "wait"
    while it is stopping, else "stop" it (StopInstances is idempotent)."""
    if state in FENCED_STATES:
        return "mark"
    return "wait" if state in STOPPING_STATES else "stop"


def sigv4_headers(method: str, url: str, body: bytes, headers: dict[str, str], credentials: dict[str, str],
                  region: str, service: str, now: datetime) -> dict[str, str]:
    """`headers` plus X-Amz-Date, X-Amz-Security-Token and the Authorization of AWS Signature Version 4 (IAM user
    guide, "Create a signed AWS API request"), every given header signed."""
    parts = urllib.parse.urlsplit(url)
    stamp, day = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
    signed = {**{k.lower(): v.strip() for k, v in headers.items()}, "host": parts.netloc, "x-amz-date": stamp}
    if credentials.get("Token"):
        signed["x-amz-security-token"] = credentials["Token"]
    names = sorted(signed)
    query = "&".join(sorted(f"{urllib.parse.quote(k, safe='-_.~')}={urllib.parse.quote(v, safe='-_.~')}"
                            for k, v in urllib.parse.parse_qsl(parts.query, keep_blank_values=True)))
    canonical = "\n".join([method, parts.path or "/", query, *(f"{n}:{signed[n]}" for n in names), "",
                           ";".join(names), hashlib.sha256(body).hexdigest()])
    scope = f"{day}/{region}/{service}/aws4_request"
    to_sign = "\n".join(["AWS4-HMAC-SHA256", stamp, scope, hashlib.sha256(canonical.encode()).hexdigest()])
    key = f"AWS4{credentials['SecretAccessKey']}".encode()
    for part in (day, region, service, "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    authorization = (f"AWS4-HMAC-SHA256 Credential={credentials['AccessKeyId']}/{scope}, "
                     f"SignedHeaders={';'.join(names)}, Signature={signature}")
    return {**headers, "X-Amz-Date": stamp, **({"X-Amz-Security-Token": credentials["Token"]}
                                                  if credentials.get("Token") else {}),
            "Authorization": authorization}


def instance_state(response: bytes) -> str:
    """The instance state name in a DescribeInstances response for one instance."""
    for element in ElementTree.fromstring(response).iter():
        if element.tag.endswith("}instanceState"):
            return next(child.text for child in element if child.tag.endswith("}name"))
    raise ValueError("DescribeInstances returned no instance")


class Ec2:
    """StopInstances and DescribeInstances for one instance at a time, with the Pod Identity credentials the
    EKS Pod Identity webhook points the pod at (AWS_CONTAINER_CREDENTIALS_FULL_URI and the token file in
    AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE: EKS user guide, "Understand how EKS Pod Identity works")."""

    def __init__(self, region: str) -> None:
        self.region = region
        self.url = f"https://ec2.{region}.amazonaws.com/"
        self._credentials: dict[str, str] = {}

    def _fresh_credentials(self) -> dict[str, str]:
        expires = self._credentials.get("Expiration", "")
        if not expires or datetime.fromisoformat(expires.replace("Z", "+00:00")).timestamp() - time.time() < 300:
            with open(os.environ["AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE"]) as f:
                token = f.read().strip()
            request = urllib.request.Request(os.environ["AWS_CONTAINER_CREDENTIALS_FULL_URI"],
                                             headers={"Authorization": token})
            with urllib.request.urlopen(request, timeout=10) as response:
                self._credentials = json.load(response)
        return self._credentials

    def _call(self, action: str, **params: str) -> bytes:
        body = urllib.parse.urlencode({"Action": action, "Version": EC2_API_VERSION, **params}).encode()
        headers = sigv4_headers("POST", self.url, body,
                                {"Content-Type": "application/x-www-form-urlencoded; charset=utf-8"},
                                self._fresh_credentials(), self.region, "ec2", datetime.now(timezone.utc))
        request = urllib.request.Request(self.url, data=body, method="POST", headers=headers)
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.read()

    def state(self, instance: str) -> str:
        return instance_state(self._call("DescribeInstances", **{"InstanceId.1": instance}))

    def stop(self, instance: str) -> None:
        self._call("StopInstances", **{"InstanceId.1": instance, "Force": "true"})


def poll(nodes: list[dict], now: datetime, threshold_s: float, ec2: Ec2,
         patch: Callable[[str, list[dict]], object]) -> None:
    """One round: fence each silent node, mark it once fenced, unmark a marked node that reports Ready again."""
    by_name = {n["metadata"]["name"]: n for n in nodes}
    for name in to_mark(nodes, now, threshold_s):
        silent = f"node {name} silent for {silent_for_s(by_name[name], now):.0f} s"
        instance = instance_id(by_name[name])
        if instance is None:
            print(f"{silent}: not marked, no EC2 instance id in its providerID to fence it by",
                  file=sys.stderr, flush=True)
            continue
        state = ec2.state(instance)
        step = fence_step(state)
        if step == "stop":
            ec2.stop(instance)
            print(f"{silent}: stopping {instance} ({state}) to fence it before marking", flush=True)
        elif step == "mark":
            patch(name, taint_patch(by_name[name], mark=True))
            print(f"{silent}: {instance} {state}, marked {OUT_OF_SERVICE}", flush=True)
    for name in to_unmark(nodes):
        patch(name, taint_patch(by_name[name], mark=False))
        print(f"node {name} reports Ready again: {OUT_OF_SERVICE} removed", flush=True)


def main(threshold_s: float, selector: str, region: str) -> None:
    with open(f"{ACCOUNT}/token") as f:
        token = f.read().strip()
    tls = ssl.create_default_context(cafile=f"{ACCOUNT}/ca.crt")
    ec2 = Ec2(region)

    def call(method: str, path: str, body: list | None = None) -> dict:
        request = urllib.request.Request(f"{API}/api/v1/{path}", method=method,
                                         data=json.dumps(body).encode() if body is not None else None,
                                         headers={"Authorization": f"Bearer {token}",
                                                  "Content-Type": "application/json-patch+json"})
        with urllib.request.urlopen(request, context=tls, timeout=30) as response:
            return json.load(response)

    while True:
        try:
            nodes = call("GET", f"nodes?labelSelector={urllib.parse.quote(selector)}")["items"]
            poll(nodes, datetime.now(timezone.utc), threshold_s, ec2,
                 lambda name, body: call("PATCH", f"nodes/{name}", body))
        # The API unreachable, a conflict, a denied or failed EC2 call: the next poll retries.
        except (OSError, ValueError, KeyError, ElementTree.ParseError) as err:
            print(f"poll failed, retrying in {POLL_S:g} s: {err}", file=sys.stderr, flush=True)
        time.sleep(POLL_S)


if __name__ == "__main__":
    main(float(sys.argv[1]), sys.argv[2], sys.argv[3])
