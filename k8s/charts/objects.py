"""Plain-dict Kubernetes objects on cdk8s core (no cdk8s-plus): schemas are checked by kubernetes-validate."""
from __future__ import annotations

from typing import Any, Mapping

from cdk8s import ApiObject, JsonPatch
from constructs import Construct

from infra.config import TRAINING_UID

# Every pod of the charts: the container runtime's default seccomp profile.
POD_SECURITY_CONTEXT: Mapping[str, Any] = {"seccompProfile": {"type": "RuntimeDefault"}}
# The pods of the training image (trainer, store, report): its own user, never root. No fsGroup: the FSx
# CSI driver does not apply one to a ReadWriteMany volume (and a recursive chown of a Lustre tree would
# take hours); the Job's directory on FSx is given to this user by the trainer's init container.
TRAINING_POD_SECURITY_CONTEXT: Mapping[str, Any] = {**POD_SECURITY_CONTEXT, "runAsNonRoot": True,
                                                    "runAsUser": TRAINING_UID, "runAsGroup": TRAINING_UID}
# Every container of the charts: no privilege escalation, no Linux capabilities, a read-only root
# filesystem (what a container writes goes to an emptyDir or its directory on FSx).
CONTAINER_SECURITY_CONTEXT: Mapping[str, Any] = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                                                 "readOnlyRootFilesystem": True}


def api_object(scope: Construct, id: str, *, api_version: str, kind: str, name: str,
               namespace: str | None = None, body: Mapping[str, Any] | None = None,
               labels: Mapping[str, str] | None = None,
               annotations: Mapping[str, str] | None = None) -> ApiObject:
    """An ApiObject with a fixed name (no cdk8s hash suffix) and top-level fields such as spec."""
    metadata: dict[str, Any] = {"name": name}
    if namespace:
        metadata["namespace"] = namespace
    if labels:
        metadata["labels"] = dict(labels)
    if annotations:
        metadata["annotations"] = dict(annotations)
    obj = ApiObject(scope, id, api_version=api_version, kind=kind, metadata=metadata)
    for key, value in (body or {}).items():
        obj.add_json_patch(JsonPatch.add(f"/{key}", value))
    return obj


def checkov_skips(reasons: Mapping[str, str]) -> dict[str, str]:
    """Annotations that suppress checkov checks on this object, each with its reason."""
    for check, reason in reasons.items():
        # checkov splits the annotation value on "=": a second one would break its parser.
        if not reason or "=" in reason:
            raise ValueError(f"{check}: a skip needs a reason without '=': {reason!r}")
    return {f"checkov.io/skip{i}": f"{check}={reason}" for i, (check, reason) in enumerate(reasons.items(), 1)}
