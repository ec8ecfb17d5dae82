"""Issue 16 on the rendered manifests: which connections the NetworkPolicies allow (a small evaluator of
the policy semantics over the rendered pods' labels and ports), Pod Security Admission's profiles on every
pod, and the Job's view of FSx."""
from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import NamedTuple

import pytest
import yaml
from k8s_render import run_main

from infra.config import MONITORING_NAMESPACE, NAMESPACE, RENDEZVOUS_PORT, TRAINING_UID
from infra.training_volume import POD_SECURITY

METRICS_PORT = 9464  # k8s/train.yaml
API_SERVER_ENI = "10.0.12.34"  # an address in the VPC: the API server's private endpoint


class Peer(NamedTuple):
    namespace: str
    labels: dict[str, str]
    ip: str = "10.0.99.99"


def _pod_template(obj: dict) -> dict:
    spec = obj["spec"]
    if obj["kind"] == "CronJob":
        spec = spec["jobTemplate"]["spec"]
    return spec["template"]


def _pod_specs(objects: list[dict]) -> dict[str, dict]:
    """Every workload's pod template by name (the MPIJob's replicas each, as <name>-<role>)."""
    found = {}
    for obj in objects:
        if obj["kind"] in ("Job", "Deployment", "CronJob"):
            found[obj["metadata"]["name"]] = _pod_template(obj)
        elif obj["kind"] == "MPIJob":
            found |= {f"{obj['metadata']['name']}-{role.lower()}": replica["template"]
                      for role, replica in obj["spec"]["mpiReplicaSpecs"].items()}
    return found


def _matches(selector: dict, labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, selector  # the charts use matchLabels only
    return set(selector.get("matchLabels", {}).items()) <= set(labels.items())


def _peer_matches(rule_peer: dict, peer: Peer, policy_namespace: str) -> bool:
    if "ipBlock" in rule_peer:
        return ipaddress.ip_address(peer.ip) in ipaddress.ip_network(rule_peer["ipBlock"]["cidr"])
    if "namespaceSelector" in rule_peer:
        namespace_ok = _matches(rule_peer["namespaceSelector"], {"kubernetes.io/metadata.name": peer.namespace})
    else:
        namespace_ok = peer.namespace == policy_namespace
    return namespace_ok and _matches(rule_peer.get("podSelector", {}), peer.labels)


def _port_matches(ports: list[dict] | None, port: int, protocol: str) -> bool:
    return not ports or any(p.get("protocol", "TCP") == protocol and p["port"] == port for p in ports)


def _allowed_one_way(policies: list[dict], pod: Peer, other: Peer, port: int, protocol: str, direction: str) -> bool:
    """Kubernetes semantics: a pod selected by no policy of that direction is open; else some rule must allow."""
    kind, key, side = ("Ingress", "ingress", "from") if direction == "in" else ("Egress", "egress", "to")
    selecting = [p for p in policies if p["metadata"]["namespace"] == pod.namespace
                 and kind in p["spec"]["policyTypes"] and _matches(p["spec"]["podSelector"], pod.labels)]
    if not selecting:
        return True
    return any((side not in rule or any(_peer_matches(peer, other, p["metadata"]["namespace"]) for peer in rule[side]))
               and _port_matches(rule.get("ports"), port, protocol)
               for p in selecting for rule in p["spec"].get(key, []))


def allowed(policies: list[dict], source: Peer, target: Peer, port: int, protocol: str = "TCP") -> bool:
    """Egress of the source and ingress of the target both allow it (a peer outside the namespace has no policy)."""
    return (_allowed_one_way(policies, source, target, port, protocol, "out")
            and _allowed_one_way(policies, target, source, port, protocol, "in"))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Everything the namespace can hold at once: training, chaos drill, report and preflight."""
    def render(*args):
        rc, outdir = run_main(tmp_path_factory.mktemp("r"), *args)
        assert rc == 0
        return [d for p in sorted(outdir.glob("*.k8s.yaml")) for d in yaml.safe_load_all(p.read_text()) if d]

    objects = render("--fault-injection") + render("--report") + render("--preflight")
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    peers = {name: Peer(NAMESPACE, template["metadata"]["labels"]) for name, template in _pod_specs(objects).items()}
    return policies, peers, objects


DNS = Peer("kube-system", {"k8s-app": "kube-dns"})
PROMETHEUS = Peer(MONITORING_NAMESPACE, {"app.kubernetes.io/name": "prometheus", "app.kubernetes.io/component": "server"})
INTRUDER = Peer(NAMESPACE, {"app.kubernetes.io/name": "something-else"})
OTHER_NAMESPACE = Peer("default", {"app.kubernetes.io/name": "fsdp-train", "app.kubernetes.io/component": "trainer"})
INTERNET = Peer("", {}, ip="203.0.113.7")


def test_every_pod_of_the_namespace_is_denied_by_default(cluster):
    policies, _, _ = cluster
    (deny,) = [p for p in policies if p["metadata"]["name"] == "default-deny"]
    assert deny["spec"] == {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]}
    # a pod no chart knows: nothing in, nothing out
    for other, port in ((DNS, 53), (INTERNET, 443), (Peer(NAMESPACE, {}), 22)):
        assert not allowed(policies, INTRUDER, other, port)
        assert not allowed(policies, other, INTRUDER, port)


def test_what_the_trainers_need_is_allowed(cluster):
    policies, pods, _ = cluster
    trainer, store = pods["fsdp-train"], pods["fsdp-train-rendezvous"]
    assert allowed(policies, trainer, store, RENDEZVOUS_PORT)
    for port in (RENDEZVOUS_PORT + 1, 45123):  # the ranks' c10d store / in-process store, gloo and NCCL bootstrap
        assert allowed(policies, trainer, trainer, port)
    assert allowed(policies, trainer, DNS, 53, "UDP") and allowed(policies, trainer, DNS, 53, "TCP")
    assert allowed(policies, PROMETHEUS, trainer, METRICS_PORT)


def test_the_store_takes_only_the_trainers_on_the_rendezvous_port(cluster):
    policies, pods, _ = cluster
    trainer, store = pods["fsdp-train"], pods["fsdp-train-rendezvous"]
    assert not allowed(policies, trainer, store, 22)
    for intruder in (INTRUDER, OTHER_NAMESPACE, PROMETHEUS, pods["fsdp-train-report"], pods["fsdp-train-chaos"],
                     pods["fsdp-train-nccl-preflight-worker"]):
        assert not allowed(policies, intruder, store, RENDEZVOUS_PORT), intruder
    for anywhere in (INTERNET, DNS, trainer):  # it connects to nothing
        assert not allowed(policies, store, anywhere, 443)


def test_the_trainers_take_nothing_else_and_reach_nothing_else(cluster):
    policies, pods, _ = cluster
    trainer = pods["fsdp-train"]
    for intruder in (INTRUDER, OTHER_NAMESPACE, pods["fsdp-train-chaos"], pods["fsdp-train-nccl-preflight-launcher"]):
        assert not allowed(policies, intruder, trainer, 29400)
    assert not allowed(policies, Peer("default", PROMETHEUS.labels), trainer, METRICS_PORT)  # the scraper's namespace
    assert not allowed(policies, PROMETHEUS, trainer, 29400)  # the metrics port only
    assert not allowed(policies, trainer, INTERNET, 443) and not allowed(policies, trainer, INTRUDER, 80)


def test_report_chaos_and_preflight_reach_only_what_they_need(cluster):
    policies, pods, _ = cluster
    report, chaos = pods["fsdp-train-report"], pods["fsdp-train-chaos"]
    launcher, worker = pods["fsdp-train-nccl-preflight-launcher"], pods["fsdp-train-nccl-preflight-worker"]
    assert not any(allowed(policies, report, peer, port) for peer, port in ((DNS, 53), (INTERNET, 443)))
    assert allowed(policies, chaos, DNS, 53, "UDP") and allowed(policies, chaos, Peer("", {}, API_SERVER_ENI), 443)
    assert not allowed(policies, chaos, pods["fsdp-train"], 443) and not allowed(policies, chaos, INTERNET, 443)
    assert allowed(policies, launcher, worker, 22) and allowed(policies, worker, launcher, 40000)
    assert not allowed(policies, launcher, pods["fsdp-train"], 22) and not allowed(policies, INTRUDER, worker, 22)


def test_metrics_off_admits_no_scraper(render):
    r = render("--set", "metrics.port=0")
    policies = [o for o in r.objects() if o["kind"] == "NetworkPolicy"]
    trainer = Peer(NAMESPACE, r.one("Job")["spec"]["template"]["metadata"]["labels"])
    assert not allowed(policies, PROMETHEUS, trainer, METRICS_PORT)


# ---- Pod Security Admission -----------------------------------------------------------------------
BASELINE_CAPABILITIES = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD", "NET_BIND_SERVICE",
                         "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected",
                      "secret"}


def _containers(pod: dict) -> list[dict]:
    return [*pod.get("initContainers", []), *pod["containers"]]


def baseline_violations(pod: dict) -> list[str]:
    found = [f"hostPath {v['name']}" for v in pod.get("volumes", []) if "hostPath" in v]
    found += [f"host namespace {k}" for k in ("hostNetwork", "hostPID", "hostIPC") if pod.get(k)]
    for c in _containers(pod):
        security = c.get("securityContext", {})
        if security.get("privileged"):
            found.append(f"{c['name']} privileged")
        found += [f"{c['name']} adds {cap}" for cap in security.get("capabilities", {}).get("add", [])
                  if cap not in BASELINE_CAPABILITIES]
        found += [f"{c['name']} hostPort" for p in c.get("ports", []) if p.get("hostPort")]
    return found


def restricted_violations(pod: dict) -> list[str]:
    found = baseline_violations(pod)
    found += [f"volume {v['name']}" for v in pod.get("volumes", []) if not set(v) - {"name"} <= RESTRICTED_VOLUMES]
    pod_security = pod.get("securityContext", {})
    for c in _containers(pod):
        security = {**pod_security, **c.get("securityContext", {})}
        if security.get("allowPrivilegeEscalation") is not False:
            found.append(f"{c['name']} may escalate")
        if security.get("runAsNonRoot") is not True or security.get("runAsUser") == 0:
            found.append(f"{c['name']} may run as root")
        if security.get("seccompProfile", {}).get("type") not in ("RuntimeDefault", "Localhost"):
            found.append(f"{c['name']} seccomp")
        capabilities = security.get("capabilities", {})
        if "ALL" not in capabilities.get("drop", []) or set(capabilities.get("add", [])) - {"NET_BIND_SERVICE"}:
            found.append(f"{c['name']} capabilities")
    return found


def test_the_namespace_enforces_baseline_and_warns_restricted():
    assert POD_SECURITY == {"pod-security.kubernetes.io/enforce": "baseline",
                            "pod-security.kubernetes.io/warn": "restricted",
                            "pod-security.kubernetes.io/audit": "restricted"}


def test_every_pod_meets_baseline_and_all_but_the_preflight_and_fsx_owner_meet_restricted(cluster):
    _, _, objects = cluster
    pods = {name: template["spec"] for name, template in _pod_specs(objects).items()}
    assert {name: baseline_violations(pod) for name, pod in pods.items() if baseline_violations(pod)} == {}
    restricted = {name: restricted_violations(pod) for name, pod in pods.items()}
    # The preflight (sshd, mpirun as root) and the fsx-owner init container of the trainer and the store:
    # docs/security.md.
    fsx_owner = ["fsx-owner may run as root", "fsx-owner capabilities"]
    assert restricted["fsdp-train"] == restricted["fsdp-train-rendezvous"] == fsx_owner
    assert restricted["fsdp-train-nccl-preflight-launcher"] and restricted["fsdp-train-nccl-preflight-worker"]
    assert all(not found for name, found in restricted.items()
               if "preflight" not in name and name not in ("fsdp-train", "fsdp-train-rendezvous"))


def test_the_image_pods_run_as_the_images_user_with_a_read_only_root(cluster):
    _, _, objects = cluster
    dockerfile = (Path(__file__).resolve().parents[2] / "training" / "Dockerfile").read_text()
    assert f"USER {TRAINING_UID}:{TRAINING_UID}" in dockerfile.splitlines()
    assert f"useradd --uid {TRAINING_UID} --gid {TRAINING_UID}" in dockerfile
    for name in ("fsdp-train", "fsdp-train-rendezvous", "fsdp-train-report"):
        pod = _pod_specs(objects)[name]["spec"]
        assert (pod["securityContext"]["runAsUser"], pod["securityContext"]["runAsNonRoot"]) == (TRAINING_UID, True)
        assert all(c["securityContext"]["readOnlyRootFilesystem"] for c in pod["containers"])


def test_every_gpu_container_with_a_read_only_root_has_a_writable_etc_nvidia(cluster):
    """nvidia-container-toolkit 1.20.0 (AL2023 NVIDIA AMIs from v20260818) creates a directory under /etc/nvidia
    in each GPU container at create time and aborts the container on a read-only file system (amazon-eks-ami
    issue 2790): every such container gets a writable emptyDir there."""
    _, _, objects = cluster
    checked = []
    for name, template in _pod_specs(objects).items():
        pod = template["spec"]
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for c in pod["containers"]:
            if "nvidia.com/gpu" not in c["resources"].get("limits", {}):
                continue
            if not c.get("securityContext", {}).get("readOnlyRootFilesystem"):
                continue
            [mount] = [m for m in c["volumeMounts"] if m["mountPath"] == "/etc/nvidia"]
            assert not mount.get("readOnly") and "emptyDir" in volumes[mount["name"]], (name, c["name"])
            checked.append(name)
    assert "fsdp-train" in checked


# ---- the Job's view of FSx ------------------------------------------------------------------------
def test_each_pod_mounts_only_its_jobs_directory_and_the_init_gives_it_to_the_training_user(render):
    r = render("--set", "run_dir=/fsx/teams/a/run-1", "--set", "data.path=/fsx/data/tokens.bin")
    mounts = {m["mountPath"]: m for m in r.container["volumeMounts"] if m["name"] == "fsx"}
    assert mounts == {
        "/fsx/teams/a/run-1": {"name": "fsx", "mountPath": "/fsx/teams/a/run-1", "subPath": "teams/a/run-1",
                               "readOnly": False},
        "/fsx/data": {"name": "fsx", "mountPath": "/fsx/data", "subPath": "data", "readOnly": True}}
    (init,) = r.pod["initContainers"]
    assert init["command"][-1] == (f"mkdir -p /fsx/teams/a/run-1 && chown {TRAINING_UID}:{TRAINING_UID} "
                                   "/fsx/teams/a/run-1 && chmod 0700 /fsx/teams/a/run-1")
    assert init["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN", "FOWNER"]}


def test_the_store_creates_the_jobs_directory_it_mounts_read_only_before_it_starts(render):
    """On a fresh run the store may start before any trainer: the kubelet cannot create a missing subPath
    on a read-only volume, so the store pod's own init container makes it, writable there only."""
    r = render("--set", "run_dir=/fsx/teams/a/run-1")
    pod = r.store["spec"]["template"]["spec"]
    (store,) = pod["containers"]
    assert [m for m in store["volumeMounts"] if m["name"] == "fsx"] == [
        {"name": "fsx", "mountPath": "/fsx/teams/a/run-1", "subPath": "teams/a/run-1", "readOnly": True}]
    assert pod["initContainers"] == r.pod["initContainers"]  # the trainer's fsx-owner: mkdir, chown, chmod
    (init,) = pod["initContainers"]
    assert init["volumeMounts"] == [{"name": "fsx", "mountPath": "/fsx"}]
    (fsx,) = [v for v in pod["volumes"] if v["name"] == "fsx"]
    assert fsx["persistentVolumeClaim"].get("readOnly", False) is False


@pytest.mark.parametrize("overrides, key", [
    (["run_dir=/fsx/../etc"], "run_dir='/etc'"),
    (["run_dir=/fsx/runs/../.."], "run_dir='/'"),
    (["run_dir=/fsx/."], "run_dir='/fsx'"),
    (["checkpoint.dir=/fsx/runs/other-job/checkpoints"], "checkpoint.dir='/fsx/runs/other-job/checkpoints'"),
    (["checkpoint.dir=../other/checkpoints"], "checkpoint.dir='/fsx/runs/other/checkpoints'"),
])
def test_paths_are_normalised_before_the_fsx_checks(render_error, overrides, key):
    err = render_error(*[arg for o in overrides for arg in ("--set", o)])
    assert key in err


def test_destructive_faults_need_the_chaos_switch(render, render_error):
    err = render_error("--set", "faults=[corrupt-ckpt@25]")
    assert "corrupt-ckpt@25" in err and "--allow-destructive-faults" in err
    r = render("--set", "faults=[corrupt-ckpt@25, exception@5:rank=1]", "--allow-destructive-faults")
    (train_yaml,) = r.config_map("fsdp-train-config").values()
    assert "allow_destructive_faults: true" in train_yaml
    (train_yaml,) = render().config_map("fsdp-train-config").values()
    assert "allow_destructive_faults: false" in train_yaml
