"""The NCCL/EFA preflight (`python k8s/main.py --preflight`): nccl-tests all_reduce_perf, all_gather_perf,
reduce_scatter_perf and broadcast_perf, one after the other, across every GPU node the Job runs on (its
training nodes and spares), each checked by k8s.nccl_check against its own floor.

An MPIJob (Kubeflow MPI Operator v2, kubeflow.org/v2beta1), as awsome-distributed-training and the EKS
user guide's EFA page run nccl-tests: multi-node nccl-tests are MPI programs, one rank per GPU, and the
operator starts the workers, hands the launcher their hostfile and SSH keys, and runs mpirun once they
are up. The operator is a cluster prerequisite (docs/deploying.md). Workers and launcher run the training image,
which carries the EFA installer's Open MPI, aws-ofi-nccl and nccl-tests (training/Dockerfile).
"""
from __future__ import annotations

from pathlib import Path, PurePosixPath

import cdk8s
from cdk8s import Chart
from constructs import Construct

from infra.config import GPU_NODE_LABEL, GPU_TAINT_KEY, SYSTEM_NODE_LABEL
from k8s import nccl_check
from k8s.charts.network import among_themselves, network_policy
from k8s.charts.objects import CONTAINER_SECURITY_CONTEXT, POD_SECURITY_CONTEXT, api_object
from k8s.charts.training import efa_env, gpu_pod_resources
from k8s.job_config import JobConfig, JobConfigError

CHECK_SCRIPT = Path(nccl_check.__file__)
CHECK_MOUNT = "/preflight"
NCCL_TESTS_BUILD = "/opt/nccl-tests/build"
# What FSDP2 moves its bytes with (all-gather, reduce-scatter) besides all-reduce, and broadcast, which
# aws-ofi-nccl 1.18.0 hung on while all-reduce passed (fixed in 1.20.0, aws/deep-learning-containers PR 6551).
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
PERF_BINARIES = {collective: f"{NCCL_TESTS_BUILD}/{collective}_perf" for collective in COLLECTIVES}
# 8 B to 16 GiB, doubling: the largest sizes show the fabric's bandwidth (awsome-distributed-training's run).
PERF_ARGS = ["-b", "8", "-e", "16G", "-f", "2", "-g", "1", "-c", "1", "-n", "100"]
# Each collective's run is killed after this long and reported as hung. A healthy p5 run of one collective
# takes about half a minute (the sweep moves ~32 GiB a call at ~0.1 s per 16 GiB, 105 calls with warm-up);
# ten minutes leave room for NCCL's start and for more nodes. A TCP fallback is also cut short here.
COLLECTIVE_TIMEOUT_S = 600
# Each worker writes "<pod hostname> <node name>" here at start (the downward API's spec.nodeName): NCCL
# names hosts by pod hostname, the check names the node to cordon too. On the shm emptyDir: writable, and
# a process that mpirun starts over SSH does not inherit the container's environment.
NODE_NAME_FILE = "/dev/shm/node-name"
# What sshd needs to accept the launcher's connections (privilege separation) and to bind port 22 with
# every other capability dropped (NET_BIND_SERVICE: the MPI Operator's base image grants sshd the same, its
# build/base/Dockerfile `setcap CAP_NET_BIND_SERVICE=+eip /usr/sbin/sshd`). All are in the Pod Security
# Standards' baseline list of capabilities that may be added.
SSHD_CAPABILITIES = ["SETUID", "SETGID", "SYS_CHROOT", "CHOWN", "AUDIT_WRITE", "KILL", "NET_BIND_SERVICE"]
SSH_PORT = 22
# The launcher's runs that fail before any verdict: a worker's name not yet in DNS, sshd refusing an early
# connection. Retried with the Job controller's backoff (10 s, 20 s, 40 s...); a failing verdict fails again
# the same way each time, and every attempt's pod stays for `kubectl logs`.
LAUNCHER_BACKOFF_LIMIT = 3
# mpirun and sshd run as root here (the MPI Operator's keys, sshd's privilege separation) and sshd writes
# its pid and host state on the root filesystem: the preflight is why the namespace enforces PSA baseline,
# not restricted. It runs briefly, before the training, with no FSx and no service account token.
PREFLIGHT_CONTAINER_SECURITY_CONTEXT = {**CONTAINER_SECURITY_CONTEXT, "readOnlyRootFilesystem": False}
PREFLIGHT_POD_SECURITY_CONTEXT = {**POD_SECURITY_CONTEXT, "runAsUser": 0}  # the image's USER is the training user


def preflight_name(job: JobConfig) -> str:
    return f"{job.name}-nccl-preflight"


def _mpirun(job: JobConfig) -> list[str]:
    gpus = job.instance.gpus
    nccl_env = {**efa_env(job), "NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET"}
    exports = [arg for key, value in nccl_env.items() for arg in ("-x", f"{key}={value}")]
    return [
        "mpirun", "--allow-run-as-root", "--tag-output", "-np", str(job.pods * gpus), "-N", str(gpus),
        "--bind-to", "none", "-x", "PATH", "-x", "LD_LIBRARY_PATH", *exports,
        # Open MPI's own traffic (launch, bootstrap) over TCP on the pod network; NCCL's over EFA. pml ^cm,ucx
        # as the EKS EFA examples pass it (aws-samples/aws-efa-eks nccl-efa-tests.yaml excludes cm): cm would
        # carry MPI's messages over libfabric's EFA provider beside NCCL, and UCX has no EFA transport.
        "--mca", "pml", "^cm,ucx", "--mca", "btl", "tcp,self", "--mca", "btl_tcp_if_exclude", "lo,docker0",
        f"{NCCL_TESTS_BUILD}/{nccl_check.PLACEHOLDER}_perf", *PERF_ARGS,
    ]


def _node_names(job: JobConfig) -> str:
    """The check's --node-names: each worker's NODE_NAME_FILE, one line per worker."""
    return f"mpirun --allow-run-as-root -np {job.pods} -N 1 cat {NODE_NAME_FILE}"


def _pod_labels(job: JobConfig) -> dict[str, str]:
    return {"app.kubernetes.io/name": preflight_name(job)}


def _launcher(job: JobConfig, config_map: str) -> dict:
    script = str(PurePosixPath(CHECK_MOUNT) / CHECK_SCRIPT.name)
    facts = job.instance
    floors = [arg for c in COLLECTIVES for arg in ("--floor", f"{c}={facts.min_busbw_gbs(c):g}")]
    check = ["python3", script, "--instance-type", facts.name, *floors, "--nodes", str(job.pods),
             "--timeout-s", str(COLLECTIVE_TIMEOUT_S), "--node-names", _node_names(job), "--"]
    return {"replicas": 1, "template": {"metadata": {"labels": _pod_labels(job)}, "spec": {
        "restartPolicy": "Never",  # each attempt (LAUNCHER_BACKOFF_LIMIT) is a pod of its own, its log kept
        "nodeSelector": {SYSTEM_NODE_LABEL: "true"},  # no GPU needed: mpirun only starts the ranks
        "securityContext": dict(PREFLIGHT_POD_SECURITY_CONTEXT),
        "containers": [{
            "name": "launcher", "image": job.infra.image_uri, "imagePullPolicy": "IfNotPresent",
            "command": [*check, *_mpirun(job)],
            "resources": {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"memory": "2Gi"}},
            "securityContext": dict(PREFLIGHT_CONTAINER_SECURITY_CONTEXT),
            "volumeMounts": [{"name": "check", "mountPath": CHECK_MOUNT, "readOnly": True}],
        }],
        "volumes": [{"name": "check", "configMap": {"name": config_map}}],
    }}}


def _worker(job: JobConfig) -> dict:
    resources = gpu_pod_resources(job)
    security = {**PREFLIGHT_CONTAINER_SECURITY_CONTEXT, "capabilities": {"drop": ["ALL"], "add": SSHD_CAPABILITIES}}
    return {"replicas": job.pods, "template": {"metadata": {"labels": _pod_labels(job)}, "spec": {
        "nodeSelector": {"node.kubernetes.io/instance-type": job.instance.name, GPU_NODE_LABEL: "true"},
        "tolerations": [{"key": GPU_TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"}],
        "securityContext": dict(PREFLIGHT_POD_SECURITY_CONTEXT),
        "containers": [{
            "name": "worker", "image": job.infra.image_uri, "imagePullPolicy": "IfNotPresent",
            # the launcher's mpirun starts the ranks over SSH
            "command": ["/bin/sh", "-c", f'echo "$(hostname) $NODE_NAME" > {NODE_NAME_FILE} && exec /usr/sbin/sshd -De'],
            "env": [{"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}],
            "resources": {"requests": resources, "limits": resources},
            "securityContext": security,
            "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
            # Ready once sshd listens: the operator creates the launcher only then (WaitForWorkersReady).
            "readinessProbe": {"tcpSocket": {"port": SSH_PORT}, "periodSeconds": 2, "failureThreshold": 1},
        }],
        # NCCL's intra-node buffers; the container default is 64 MiB.
        "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{job.shm_gib}Gi"}}],
    }}}


class PreflightChart(Chart):
    def __init__(self, scope: Construct, id: str, job: JobConfig) -> None:
        super().__init__(scope, id, labels={"app.kubernetes.io/name": preflight_name(job),
                                            "app.kubernetes.io/part-of": job.infra.cluster_name})
        if not job.instance.efa_interfaces:
            raise JobConfigError(f"--preflight checks NCCL over EFA; gpuInstanceType={job.instance.name} has no "
                                 "EFA interfaces (nothing to check)")
        name, ns = preflight_name(job), job.namespace
        config_map = f"{name}-check"
        api_object(self, "check", api_version="v1", kind="ConfigMap", name=config_map, namespace=ns,
                   body={"data": {CHECK_SCRIPT.name: CHECK_SCRIPT.read_text()}})
        api_object(self, "mpijob", api_version="kubeflow.org/v2beta1", kind="MPIJob", name=name, namespace=ns,
                   body={"spec": {
                       "slotsPerWorker": job.instance.gpus,
                       # The operator's default, AtStartup, starts the launcher at once: on fresh nodes still
                       # pulling the image its SSH attempts run out first. WaitForWorkersReady is in
                       # kubeflow.org/v2beta1 since MPI Operator v0.5.0 (PR 484; docs/deploying.md installs v0.6.0).
                       "launcherCreationPolicy": "WaitForWorkersReady",
                       # The launcher's exit is the verdict; finished pods stay a day for `kubectl logs`.
                       "runPolicy": {"backoffLimit": LAUNCHER_BACKOFF_LIMIT, "cleanPodPolicy": "Running",
                                     "ttlSecondsAfterFinished": job.ttl_seconds_after_finished},
                       "mpiReplicaSpecs": {"Launcher": _launcher(job, config_map), "Worker": _worker(job)},
                   }})
        # mpirun reaches the workers' sshd, Open MPI's daemons and TCP transport connect on ports of their
        # choosing among the preflight's pods; NCCL's data goes over EFA.
        network_policy(self, "network-policy", job, name, _pod_labels(job), **among_themselves(_pod_labels(job)))


def build_preflight_app(job: JobConfig, outdir: Path) -> cdk8s.App:
    """Only the preflight: applied alone, before the training Job takes the GPU nodes."""
    app = cdk8s.App(outdir=str(outdir), yaml_output_type=cdk8s.YamlOutputType.FILE_PER_CHART)
    PreflightChart(app, "nccl-preflight", job)
    return app
