"""The hung-node marker, run by its Deployment as `python -c <this file> THRESHOLD_S SELECTOR`: a node that
SELECTOR matches and whose kubelet stopped reporting (Ready condition Unknown) for THRESHOLD_S seconds is
marked out of service; a node that reports Ready again is unmarked.

Why: a node that hangs but still exists keeps its pod. After its toleration the taint manager deletes the
pod, which then stays Terminating, because no kubelet confirms that its containers stopped; the training
Job (podReplacementPolicy: Failed, which a podFailurePolicy requires) replaces a pod only once it is
Failed, and EKS node auto repair replaces the node only after 30 min NotReady. On a node with the taint
node.kubernetes.io/out-of-service, PodGC force-deletes the terminating pods and marks them Failed
(Kubernetes 1.34 docs: "Non-graceful node shutdown handling" in Node Shutdowns, and "Garbage collection of
Pods" in Pod Lifecycle); the pod already carries DisruptionTarget from the taint manager, so the Job
replaces it without counting it. Its processes may run on if the node wakes up: the kubelet then learns
the pod is gone and kills them, and NVRx has moved on to a rendezvous round without them.

Stdlib only, with the pod's service account token (RBAC: list and patch nodes, nothing else).
"""
from __future__ import annotations

import json
import ssl
import sys
import time
import urllib.parse
import urllib.request
from datetime import datetime, timezone

API = "https://kubernetes.default.svc"
ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"
OUT_OF_SERVICE = "node.kubernetes.io/out-of-service"
TAINT = {"key": OUT_OF_SERVICE, "value": "hung", "effect": "NoExecute"}  # the value says who set it
POLL_S = 10.0


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


def main(threshold_s: float, selector: str) -> None:
    with open(f"{ACCOUNT}/token") as f:
        token = f.read().strip()
    tls = ssl.create_default_context(cafile=f"{ACCOUNT}/ca.crt")

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
            by_name = {n["metadata"]["name"]: n for n in nodes}
            now = datetime.now(timezone.utc)
            for name in to_mark(nodes, now, threshold_s):
                call("PATCH", f"nodes/{name}", taint_patch(by_name[name], mark=True))
                print(f"node {name} silent for {silent_for_s(by_name[name], now):.0f} s: marked {OUT_OF_SERVICE}",
                      flush=True)
            for name in to_unmark(nodes):
                call("PATCH", f"nodes/{name}", taint_patch(by_name[name], mark=False))
                print(f"node {name} reports Ready again: {OUT_OF_SERVICE} removed", flush=True)
        except (OSError, ValueError, KeyError) as err:  # the API unreachable, a conflict: the next poll retries
            print(f"poll failed, retrying in {POLL_S:g} s: {err}", file=sys.stderr, flush=True)
        time.sleep(POLL_S)


if __name__ == "__main__":
    main(float(sys.argv[1]), sys.argv[2])
