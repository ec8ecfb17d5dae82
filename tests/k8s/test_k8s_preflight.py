"""`python k8s/main.py --preflight`: an MPIJob running nccl-tests all_reduce_perf, all_gather_perf,
reduce_scatter_perf and broadcast_perf on every GPU node of the Job, checked by k8s/nccl_check.py (NET/OFI on
every node, bus bandwidth above each collective's floor for the instance type, each run within its timeout).

kubernetes-validate knows no CRDs: the MPIJob's shape is asserted here, and each pod template is
validated strictly as a Pod."""
from __future__ import annotations

import kubernetes_validate
import pytest

from infra.config import GPU_NODE_LABEL, GPU_TAINT_KEY, NAMESPACE, SYSTEM_NODE_LABEL, PlatformConfig
from infra.instances import instance_facts
from k8s import nccl_check
from k8s.charts.preflight import COLLECTIVE_TIMEOUT_S, NODE_NAME_FILE, SSHD_CAPABILITIES

from k8s_render import IMAGE

K8S_VERSION = f"{PlatformConfig().kubernetes_version}.0"  # the schemas of the default cluster


@pytest.fixture
def preflight(render):
    return render("--preflight")


def _replica(r, kind: str) -> dict:
    return r.one("MPIJob")["spec"]["mpiReplicaSpecs"][kind]


def test_preflight_renders_only_the_mpijob_and_its_check(preflight):
    assert sorted(preflight.files) == ["nccl-preflight.k8s.yaml"]
    job = preflight.one("MPIJob")
    assert job["apiVersion"] == "kubeflow.org/v2beta1"
    assert job["metadata"] == {"name": "fsdp-train-nccl-preflight", "namespace": NAMESPACE,
                               "labels": {"app.kubernetes.io/name": "fsdp-train-nccl-preflight",
                                          "app.kubernetes.io/part-of": "ft-training"}}
    # the launcher starts once every worker's sshd listens, and a launch that fails before any verdict
    # (a worker's name not in DNS yet) is retried instead of failing the preflight
    assert job["spec"]["launcherCreationPolicy"] == "WaitForWorkersReady"
    assert job["spec"]["runPolicy"]["backoffLimit"] >= 1
    config_map = preflight.one("ConfigMap")
    assert config_map["data"] == {"nccl_check.py": open(nccl_check.__file__).read()}
    for obj in preflight.objects():
        if obj["kind"] == "ConfigMap":
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


@pytest.mark.parametrize("kind", ["Launcher", "Worker"])
def test_pod_templates_validate_strictly_as_pods(preflight, kind):
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "preflight"},
           "spec": _replica(preflight, kind)["template"]["spec"]}
    kubernetes_validate.validate(pod, K8S_VERSION, strict=True)


def test_one_worker_per_gpu_node_of_the_job_with_the_whole_node(preflight):
    p5 = instance_facts("p5.48xlarge")
    worker = _replica(preflight, "Worker")
    assert worker["replicas"] == 3  # 2 training nodes and the default hot spare: every node the Job runs on
    assert preflight.one("MPIJob")["spec"]["slotsPerWorker"] == p5.gpus
    spec = worker["template"]["spec"]
    assert spec["nodeSelector"] == {"node.kubernetes.io/instance-type": p5.name, GPU_NODE_LABEL: "true"}
    assert spec["tolerations"] == [{"key": GPU_TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"}]
    [container] = spec["containers"]
    assert container["image"] == IMAGE
    # sshd, after writing its pod's node name where the check's --node-names command reads it
    assert container["command"][-1].endswith("&& exec /usr/sbin/sshd -De")
    assert f'echo "$(hostname) $NODE_NAME" > {NODE_NAME_FILE}' in container["command"][-1]
    assert {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}} in container["env"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    assert container["readinessProbe"]["tcpSocket"] == {"port": 22}  # Ready means sshd accepts connections
    limits = container["resources"]["limits"]
    assert (limits["nvidia.com/gpu"], limits["vpc.amazonaws.com/efa"], limits["hugepages-2Mi"]) == ("8", "32", "5Gi")
    # sshd's capabilities, all within PSA baseline; no IPC_LOCK, which baseline forbids
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": SSHD_CAPABILITIES}
    assert "NET_BIND_SERVICE" in SSHD_CAPABILITIES  # port 22 with every other capability dropped
    assert spec["securityContext"]["runAsUser"] == 0  # sshd and mpirun: the image's USER is the training user


def test_launcher_runs_each_collective_across_all_ranks_through_the_check(preflight):
    p5 = instance_facts("p5.48xlarge")
    spec = _replica(preflight, "Launcher")["template"]["spec"]
    assert spec["nodeSelector"] == {SYSTEM_NODE_LABEL: "true"}
    [container] = spec["containers"]
    command = container["command"]
    check, run = command[:command.index("--")], command[command.index("--") + 1:]
    assert check == ["python3", "/preflight/nccl_check.py", "--instance-type", p5.name,
                     "--floor", "all_reduce=300", "--floor", "all_gather=240", "--floor", "reduce_scatter=240",
                     "--floor", "broadcast=200", "--nodes", "3", "--timeout-s", str(COLLECTIVE_TIMEOUT_S),
                     "--node-names", f"mpirun --allow-run-as-root -np 3 -N 1 cat {NODE_NAME_FILE}"]
    assert run[0] == "mpirun" and run[run.index("-np") + 1] == str(3 * p5.gpus) and run[run.index("-N") + 1] == "8"
    exported = {run[i + 1] for i, arg in enumerate(run) if arg == "-x"}
    mca = {run[i + 1]: run[i + 2] for i, arg in enumerate(run) if arg == "--mca"}
    assert mca["pml"] == "^cm,ucx" and mca["btl"] == "tcp,self"  # MPI's own traffic on TCP, never on EFA
    assert {"NCCL_DEBUG=INFO", "NCCL_DEBUG_SUBSYS=INIT,NET", "FI_PROVIDER=efa", "FI_EFA_USE_DEVICE_RDMA=1"} <= exported
    # the check puts each collective's name in place of the placeholder, one run after the other
    assert run[run.index("/opt/nccl-tests/build/{collective}_perf"):][1:5] == ["-b", "8", "-e", "16G"]
    assert container["volumeMounts"] == [{"name": "check", "mountPath": "/preflight", "readOnly": True}]
    assert spec["volumes"] == [{"name": "check", "configMap": {"name": "fsdp-train-nccl-preflight-check"}}]


def test_the_floors_follow_the_instance_table_and_the_node_count(render):
    r = render("--preflight", "--nodes", "4", "--spares", "0",
               context={"gpuInstanceType": "p4d.24xlarge", "gpuNodesMax": 4})
    [container] = _replica(r, "Launcher")["template"]["spec"]["containers"]
    assert container["command"][:14] == ["python3", "/preflight/nccl_check.py", "--instance-type", "p4d.24xlarge",
                                         "--floor", "all_reduce=37.5", "--floor", "all_gather=30",
                                         "--floor", "reduce_scatter=30", "--floor", "broadcast=25", "--nodes", "4"]
    assert _replica(r, "Worker")["replicas"] == 4


def test_preflight_on_an_instance_without_efa_is_refused(render_error):
    err = render_error("--preflight", "--set", "model.preset=small",
                       context={"gpuInstanceType": "g6.xlarge", "gpuNodesMin": 1, "gpuNodesDesired": 1})
    assert "g6.xlarge has no EFA interfaces" in err
