"""The Jobs of replica groups (k8s/train-replicas.yaml): one Indexed Job, store and run directory per group,
one Lighthouse for all, what the pods may reach, and the shapes the chart refuses."""
from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
from test_k8s_manifests import K8S_VERSION
from test_k8s_security import Peer, _pod_specs, allowed, restricted_violations

from infra.config import NAMESPACE, RENDEZVOUS_PORT, TRAINING_UID
from k8s.charts.training import REPLICA_SET_LABEL
from k8s.job_config import MAX_HOSTNAME
from training.contract.config import ParallelConfig, load_train_config
from training.contract.replica_groups import LIGHTHOUSE_ENV, LIGHTHOUSE_PORT, REPLICA_GROUP_ENV, lighthouse_command

REPLICAS = str(Path(__file__).resolve().parents[2] / "k8s" / "train-replicas.yaml")


def _by_name(rendered) -> dict[tuple[str, str], dict]:
    return {(o["kind"], o["metadata"]["name"]): o for o in rendered.objects()}


def test_each_group_is_a_job_of_its_own_under_one_lighthouse(render, tmp_path):
    r = render("--train-config", REPLICAS)
    objects = _by_name(r)
    for obj in r.objects():
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    lighthouse = objects["Deployment", "fsdp-train-lighthouse"]["spec"]
    (container,) = lighthouse["template"]["spec"]["containers"]
    assert container["command"] == lighthouse_command(ParallelConfig().lighthouse_options(), LIGHTHOUSE_PORT,
                                                      host="0.0.0.0")
    assert lighthouse["replicas"] == 1 and lighthouse["strategy"] == {"type": "Recreate"}
    assert {"readinessProbe", "livenessProbe"} <= set(container)
    service = objects["Service", "fsdp-train-lighthouse"]["spec"]
    assert service["ports"][0]["port"] == LIGHTHOUSE_PORT
    assert not [name for kind, name in objects if kind == "Job" and name == "fsdp-train"]  # no Job of every node
    for g in (0, 1):
        job = objects["Job", f"fsdp-train-g{g}"]["spec"]
        # 2 nodes in 2 groups: each 1 node and the spare of its own
        assert job["completions"] == job["parallelism"] == 2
        assert job["successPolicy"] == {"rules": [{"succeededCount": 1}]}  # the group's one training node
        pod = job["template"]["spec"]
        env = {e["name"]: e["value"] for e in pod["containers"][0]["env"]}
        assert env[REPLICA_GROUP_ENV] == str(g)
        assert env[LIGHTHOUSE_ENV] == f"http://fsdp-train-lighthouse.{NAMESPACE}.svc.cluster.local:{LIGHTHOUSE_PORT}"
        # torchft advertises the hostname to the other groups: it must resolve in their pods
        assert pod["setHostnameAsFQDN"] is True and pod["subdomain"] == f"fsdp-train-g{g}"
        assert len(f"fsdp-train-g{g}-1.fsdp-train-g{g}.{NAMESPACE}.svc.cluster.local") <= MAX_HOSTNAME
        args = pod["containers"][0]["args"]
        assert f"--rdzv-endpoint=fsdp-train-g{g}-rendezvous.{NAMESPACE}.svc.cluster.local:{RENDEZVOUS_PORT}" in args
        assert ("Deployment", f"fsdp-train-g{g}-rendezvous") in objects
        (train_yaml,) = r.config_map(f"fsdp-train-g{g}-config").values()
        (tmp_path / f"group{g}.yaml").write_text(train_yaml)
        train = load_train_config(tmp_path / f"group{g}.yaml")
        assert (train.run_dir, train.parallel.replica_groups) == (f"/fsx/runs/fsdp-train/group{g}", 2)
        assert {"name": "fsx", "mountPath": train.run_dir, "subPath": f"runs/fsdp-train/group{g}",
                "readOnly": False} in pod["containers"][0]["volumeMounts"]
        # it resumes from the other group's checkpoints too (one group writes each), which it may only read;
        # its init container makes that directory the training user's, not the kubelet's as root
        other = f"/fsx/runs/fsdp-train/group{1 - g}/checkpoints"
        assert train.checkpoint.also_resume_from == (other,)
        assert {"name": "fsx", "mountPath": other, "subPath": other.removeprefix("/fsx/"),
                "readOnly": True} in pod["containers"][0]["volumeMounts"]
        (owner,) = pod["initContainers"]
        assert f"mkdir -p {other} && chown {TRAINING_UID}:{TRAINING_UID} {other}" in owner["command"][-1]
    assert "2 replica groups of 1 x p5.48xlarge + 1 spare each, one Lighthouse" in r.stdout


def test_groups_talk_to_each_other_and_the_lighthouse_and_nothing_else_does(render):
    objects = render("--train-config", REPLICAS).objects()
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    pods = {name: Peer(NAMESPACE, template["metadata"]["labels"]) for name, template in _pod_specs(objects).items()}
    group0, group1, lighthouse = pods["fsdp-train-g0"], pods["fsdp-train-g1"], pods["fsdp-train-lighthouse"]
    for port in (45123, 29600):  # the cross-group all-reduce's gloo or NCCL sockets, a heal's HTTP server
        assert allowed(policies, group0, group1, port) and allowed(policies, group1, group0, port)
    assert allowed(policies, group0, lighthouse, LIGHTHOUSE_PORT) and allowed(policies, group1, lighthouse, LIGHTHOUSE_PORT)
    assert allowed(policies, group1, pods["fsdp-train-g1-rendezvous"], RENDEZVOUS_PORT)
    assert not allowed(policies, group1, pods["fsdp-train-g0-rendezvous"], RENDEZVOUS_PORT)  # its own store only
    intruder = Peer(NAMESPACE, {"app.kubernetes.io/name": "something-else"})
    for target, port in ((lighthouse, LIGHTHOUSE_PORT), (group0, 45123)):
        assert not allowed(policies, intruder, target, port)
    assert not allowed(policies, lighthouse, group0, 45123)  # it connects to nothing
    specs = {name: template["spec"] for name, template in _pod_specs(objects).items()}
    assert restricted_violations(specs["fsdp-train-lighthouse"]) == []


@pytest.mark.parametrize("args, message", [
    (("--set", "parallel.replica_groups=3"),
     "nodes=2 is not allowed with parallel.replica_groups=3: each group is whole nodes, the same number each; "
     "allowed nodes: [3]"),
    (("--spares", "2"), "nodes=2 + 2 replica groups x spares=2 = 6 exceeds gpuNodesMax=4"),
    (("--job-name", "a" * 39), "is too long for 2 replica groups: each group's Job is <name>-g<g>"),
    (("--job-name", "a" * 30), "is too long for replica groups: a pod's hostname is its FQDN"),
    (("--fault-injection", "--fault-target-index", "2"),
     "fault_injection.target_index=2 is not allowed: an index of the job (of each replica group), 0..1"),
    # one node per group at the default 2 nodes: its 8b state takes 19 s to heal over the pods' network
    (("--set", "parallel.step_timeout_s=10"), "Raise parallel.step_timeout_s to at least 29"),
])
def test_shapes_the_groups_cannot_take_are_refused_in_one_line(render_error, args, message) -> None:
    err = render_error("--train-config", REPLICAS, *args)
    assert message in err and len(err.strip().splitlines()) == 1


def test_the_report_job_reports_each_group_from_its_own_run_directory(render):
    r = render("--report", "--train-config", REPLICAS)
    jobs = {o["metadata"]["name"]: o for o in r.objects() if o["kind"] == "Job"}
    assert set(jobs) == {"fsdp-train-g0-report", "fsdp-train-g1-report"}
    for g in (0, 1):
        (container,) = jobs[f"fsdp-train-g{g}-report"]["spec"]["template"]["spec"]["containers"]
        assert f"python -m training.report --plot /fsx/runs/fsdp-train/group{g} &&" in container["command"][-1]
        assert f"kubectl logs -n {NAMESPACE} -f job/fsdp-train-g{g}-report" in r.stdout


def test_the_chaos_drill_evicts_a_pod_of_any_group(render):
    r = render("--train-config", REPLICAS, "--fault-injection", "--fault-target-index", "1")
    pod = r.one("CronJob")["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    selector = pod["containers"][0]["command"][4]
    assert selector == f"{REPLICA_SET_LABEL}=fsdp-train,batch.kubernetes.io/job-completion-index=1"
    jobs = [o for o in r.objects() if o["kind"] == "Job" and o["metadata"]["name"].startswith("fsdp-train-g")]
    assert len(jobs) == 2 and all(j["spec"]["template"]["metadata"]["labels"][REPLICA_SET_LABEL] == "fsdp-train"
                                  for j in jobs)  # the selector matches every group's pods

