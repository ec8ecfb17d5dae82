"""The chaos drill's script, run by its CronJob as `python -c <this file> NAMESPACE SELECTOR GRACE_S`:
evict one running pod that SELECTOR matches, picked at random, through the Eviction API.

An eviction, unlike a delete, marks the pod DisruptionTarget, which the training Job's
podFailurePolicy ignores: drills do not use up an index's retries. Stdlib only, with the pod's
service account token.
"""
import json
import random
import ssl
import sys
import urllib.parse
import urllib.request

API = "https://kubernetes.default.svc"
ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"


def main(namespace: str, selector: str, grace_s: str) -> None:
    with open(f"{ACCOUNT}/token") as f:
        token = f.read().strip()
    tls = ssl.create_default_context(cafile=f"{ACCOUNT}/ca.crt")

    def call(method: str, path: str, body: dict | None = None) -> dict:
        request = urllib.request.Request(f"{API}/api/v1/namespaces/{namespace}/{path}", method=method,
                                         data=json.dumps(body).encode() if body else None,
                                         headers={"Authorization": f"Bearer {token}",
                                                  "Content-Type": "application/json"})
        with urllib.request.urlopen(request, context=tls) as response:
            return json.load(response)

    pods = call("GET", f"pods?labelSelector={urllib.parse.quote(selector)}")["items"]
    running = [p["metadata"]["name"] for p in pods
               if p["status"].get("phase") == "Running" and "deletionTimestamp" not in p["metadata"]]
    if not running:
        sys.exit(f"no running pod matches {selector}")
    name = random.choice(running)
    # A grace period of 0 would remove the pod from the API at once, freeing its index while it runs.
    call("POST", f"pods/{name}/eviction", {"apiVersion": "policy/v1", "kind": "Eviction",
                                           "metadata": {"name": name, "namespace": namespace},
                                           "deleteOptions": {"gracePeriodSeconds": int(grace_s)}})
    print(f"evicted {namespace}/{name}")


if __name__ == "__main__":
    main(*sys.argv[1:])
