"""The training run: headless Service, config maps, and the Indexed Job (one ft_launcher pod per node)."""
from __future__ import annotations

import hashlib
import json
from pathlib import PurePosixPath
from typing import NamedTuple

import yaml
from cdk8s import Chart
from constructs import Construct

from infra.config import CHECKPOINT_MOUNT_PATH, GPU_NODE_LABEL, GPU_TAINT_KEY, RENDEZVOUS_PORT, SERVICE_ACCOUNT
from k8s.charts.objects import api_object, checkov_skips
from k8s.job_config import JobConfig
from k8s.launcher import FT_CONFIG_PATH, TRAIN_CONFIG_PATH, container_command, launcher_args, nvrx_ft_config
from training.exit_codes import CONFIG_ERROR, NO_PROGRESS
from training.fault_tolerance import DRAIN_MARKER_ENV

CONTAINER = "trainer"
CONFIG_COMPONENT = "config"  # the ConfigMaps' app.kubernetes.io/component label: how old ones are found
# AL2023 nodeadm `localStorage: {strategy: RAID0}` (setup-local-disks raid0) mounts the instance-store
# RAID0 at /mnt/k8s-disks/0 and bind-mounts kubelet and containerd state from subdirectories of it:
# the pod gets its own subdirectory, never the kubelet's files.
NODE_SCRATCH_PATH = "/mnt/k8s-disks/0/training-scratch"
SCRATCH_MOUNT_PATH = "/scratch"
# Written by the preStop hook, which the kubelet runs before it sends SIGTERM: the ranks then take
# that SIGTERM for a drain and commit before they leave (training/drain.py). In the pod's own
# memory-backed /dev/shm, so a replacement pod starts without it.
DRAIN_MARKER_PATH = "/dev/shm/training-drain"

# NoExecute taints the node controller puts on a node that stopped reporting: the pod leaves such a
# node after JobConfig.node_failure_toleration_s. The taint manager marks it DisruptionTarget, so the
# Job's podFailurePolicy does not count it against the index's retries.
NODE_FAILURE_TAINTS = ("node.kubernetes.io/unreachable", "node.kubernetes.io/not-ready")

# checkov findings that are inherent to this training pod, each with its reason.
JOB_CHECKOV_SKIPS = {
    "CKV_K8S_15": "the tag is fixed per build (CDK asset hash or the given imageUri); "
                  "IfNotPresent lets a replacement pod start without ECR",
    "CKV_K8S_22": "PyTorch, Triton and CUDA write JIT caches under HOME and /tmp of the NGC image",
    "CKV_K8S_23": "the NGC PyTorch image runs as root and the FSx root and node scratch directories are root-owned",
    "CKV_K8S_40": "the NGC PyTorch image runs as root and the FSx root and node scratch directories are root-owned",
    "CKV_K8S_43": "the ImageUri output tags the CDK asset by its content hash; its digest is not known when rendering",
}


class _ConfigFile(NamedTuple):
    """A file the container reads, from its own ConfigMap, mounted as its own volume."""
    volume: str
    config_map: str
    path: str
    text: str

    @property
    def data(self) -> dict[str, str]:
        return {PurePosixPath(self.path).name: self.text}


def _config_file(job: JobConfig, volume: str, kind: str, path: str, text: str) -> _ConfigFile:
    # Named after its content and immutable: a running Job's replacement pods read the config it
    # started with, whatever is applied later; a changed config is a new ConfigMap for a new Job.
    digest = hashlib.sha256(json.dumps({path: text}, sort_keys=True).encode()).hexdigest()[:10]
    return _ConfigFile(volume, f"{job.name}-{kind}-{digest}", path, text)


def _config_files(job: JobConfig) -> tuple[_ConfigFile, ...]:
    """The training config and the NVRx fault-tolerance config."""
    ft_yaml = yaml.safe_dump(nvrx_ft_config(job.train.fault_tolerance), sort_keys=False)
    return (_config_file(job, "train-config", "config", TRAIN_CONFIG_PATH, job.train.to_yaml()),
            _config_file(job, "ft-config", "ft-config", FT_CONFIG_PATH, ft_yaml))


def _pod_labels(job: JobConfig) -> dict[str, str]:
    return {"app.kubernetes.io/name": job.name, "app.kubernetes.io/component": CONTAINER}


def _training_env(job: JobConfig) -> list[dict[str, str]]:
    env: dict[str, str] = {
        "NCCL_DEBUG": "WARN",
        # Flight recorder: the last collectives of each rank, dumped on a watchdog timeout to the run
        # directory on FSx, where they outlive the pod (NVRx fault attribution reads them).
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(PurePosixPath(job.train.run_dir) / "nccl_trace_rank_"),
        DRAIN_MARKER_ENV: DRAIN_MARKER_PATH,
    }
    if job.instance.efa_interfaces:
        env |= {
            "FI_PROVIDER": "efa",
            "FI_EFA_USE_DEVICE_RDMA": "1",  # GPUDirect RDMA on p4d/p5
            "FI_EFA_FORK_SAFE": "1",  # data loader workers fork after EFA memory is registered
        }
    if job.inprocess:
        env |= {
            # NVRx in-process restart requirements (inprocess usage guide):
            # the watchdog must not kill the process, or there is nothing left to restart in-process;
            # the Wrapper's own timeouts detect hangs and abort the communicators.
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",
            "TORCH_NCCL_RETHROW_CUDA_ERRORS": "0",
            # NVLink SHARP must be off for in-process restart (usage guide, NCCL section).
            "NCCL_NVLS_ENABLE": "0",
            # The Wrapper polls the store with timed-out waits, each of which torch logs as a warning.
            "TORCH_CPP_LOG_LEVEL": "error",
        }
    else:
        # In-job restart only: on an NCCL error or timeout kill the process at once (skip the
        # communicator abort, which can itself hang on a broken link); ft_launcher restarts the group.
        env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "3"
    return [{"name": k, "value": v} for k, v in env.items()]


def _resources(job: JobConfig) -> dict[str, str]:
    facts = job.instance
    resources = {
        "cpu": str(job.pod_cpus),
        "memory": f"{facts.pod_memory_gib}Gi",
        "nvidia.com/gpu": str(facts.gpus),
    }
    if facts.efa_interfaces:
        resources["vpc.amazonaws.com/efa"] = str(facts.efa_interfaces)
    if facts.hugepages_2mi_gib:
        resources["hugepages-2Mi"] = f"{facts.hugepages_2mi_gib}Gi"  # libfabric's EFA bounce buffers
    return resources


def _pod_spec(job: JobConfig) -> dict:
    mounts = [
        {"name": "fsx", "mountPath": CHECKPOINT_MOUNT_PATH},
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "scratch", "mountPath": SCRATCH_MOUNT_PATH},
    ]
    config_files = _config_files(job)
    mounts += [{"name": f.volume, "mountPath": str(PurePosixPath(f.path).parent), "readOnly": True}
               for f in config_files]
    volumes = [
        {"name": "fsx", "persistentVolumeClaim": {"claimName": job.infra.pvc_name}},
        # NCCL and the data loaders share memory through /dev/shm; the container default is 64 MiB.
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{job.shm_gib}Gi"}},
        # Survives pod replacement on the same node (node-local checkpoints, caches).
        {"name": "scratch", "hostPath": {"path": NODE_SCRATCH_PATH, "type": "DirectoryOrCreate"}},
    ]
    volumes += [{"name": f.volume, "configMap": {"name": f.config_map}} for f in config_files]
    resources = _resources(job)
    container = {
        "name": CONTAINER,
        "image": job.infra.image_uri,
        "imagePullPolicy": "IfNotPresent",
        "command": container_command(job.train.fault_tolerance),
        "args": launcher_args(job),
        "env": _training_env(job),
        "ports": [{"name": "rendezvous", "containerPort": RENDEZVOUS_PORT}],
        "resources": {"requests": resources, "limits": resources},
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
        "volumeMounts": mounts,
        "lifecycle": {"preStop": {"exec": {"command": ["/bin/sh", "-c", f"touch {DRAIN_MARKER_PATH}"]}}},
    }
    return {
        "restartPolicy": "Never",  # the Job replaces failed pods (podFailurePolicy needs Never)
        "subdomain": job.service_name,
        "serviceAccountName": SERVICE_ACCOUNT,
        "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": job.grace_period_s,
        # Requesting all GPUs of the instance type already means one pod per node.
        "nodeSelector": {"node.kubernetes.io/instance-type": job.instance.name, GPU_NODE_LABEL: "true"},
        "tolerations": [
            {"key": GPU_TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"},
            *({"key": taint, "operator": "Exists", "effect": "NoExecute",
               "tolerationSeconds": job.node_failure_toleration_s} for taint in NODE_FAILURE_TAINTS),
        ],
        "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [container],
        "volumes": volumes,
    }


def _job_spec(job: JobConfig) -> dict:
    return {
        "completionMode": "Indexed",
        "completions": job.nodes,
        "parallelism": job.nodes,
        # Every index holds a shard: one index out of retries fails the Job (and stops its pods).
        "backoffLimitPerIndex": job.backoff_limit_per_index,
        "maxFailedIndexes": 0,
        # A replacement starts only once the old pod is gone: no two pods share a hostname.
        "podReplacementPolicy": "Failed",
        "ttlSecondsAfterFinished": job.ttl_seconds_after_finished,
        "podFailurePolicy": {"rules": [
            # Drains, evictions and preemptions are not the training's fault: retry without counting.
            {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
            # An invalid config, checkpoints that cannot load, restarts that made no progress: a
            # retry fails the same way.
            {"action": "FailJob", "onExitCodes": {"containerName": CONTAINER, "operator": "In",
                                                  "values": [CONFIG_ERROR, NO_PROGRESS]}},
        ]},
        "template": {
            "metadata": {"labels": _pod_labels(job)},
            "spec": _pod_spec(job),
        },
    }


class TrainingChart(Chart):
    def __init__(self, scope: Construct, id: str, job: JobConfig) -> None:
        super().__init__(scope, id, labels={"app.kubernetes.io/name": job.name,
                                            "app.kubernetes.io/part-of": job.infra.cluster_name})
        ns = job.namespace
        api_object(self, "service", api_version="v1", kind="Service", name=job.service_name, namespace=ns, body={
            "spec": {
                "clusterIP": "None",  # headless: DNS names <job>-<index>.<service>, no load balancing
                "publishNotReadyAddresses": True,  # the rendezvous runs before any pod could be Ready
                "selector": {"batch.kubernetes.io/job-name": job.name},
                "ports": [{"name": "rendezvous", "port": RENDEZVOUS_PORT}],
            }})
        for f in _config_files(job):
            api_object(self, f.volume, api_version="v1", kind="ConfigMap", name=f.config_map, namespace=ns,
                       labels={"app.kubernetes.io/component": CONFIG_COMPONENT},
                       body={"immutable": True, "data": f.data})
        # Ingress only from the job's own pods (rendezvous, c10d store, NCCL bootstrap sockets);
        # EFA traffic bypasses the kernel and is not subject to it. Enforced where the VPC CNI's
        # network policy agent is on; egress stays open (FSx, ECR, S3).
        pods = {"matchLabels": _pod_labels(job)}
        api_object(self, "network-policy", api_version="networking.k8s.io/v1", kind="NetworkPolicy",
                   name=job.name, namespace=ns, body={"spec": {
                       "podSelector": pods, "policyTypes": ["Ingress"],
                       "ingress": [{"from": [{"podSelector": pods}]}]}})
        api_object(self, "job", api_version="batch/v1", kind="Job", name=job.name, namespace=ns,
                   annotations=checkov_skips(JOB_CHECKOV_SKIPS), body={"spec": _job_spec(job)})
