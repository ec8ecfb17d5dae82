"""The training run: the rendezvous store (Deployment and Service), a headless Service, config maps,
and the Indexed Job (one ft_launcher pod per node, training or standing by). With replica groups, those
for every group (JobConfig.group) and one torchft Lighthouse (Deployment and Service) that they share."""
from __future__ import annotations

import hashlib
import json
import shlex
from pathlib import PurePosixPath
from typing import NamedTuple

import yaml
from cdk8s import Chart
from constructs import Construct

from infra.config import (CHECKPOINT_MOUNT_PATH, GPU_NODE_LABEL, GPU_TAINT_KEY, MONITORING_NAMESPACE, RENDEZVOUS_PORT,
                          SERVICE_ACCOUNT, SYSTEM_NODE_LABEL, TRAINING_UID)
from k8s.charts.network import among_themselves, network_policy, pods
from k8s.charts.objects import CONTAINER_SECURITY_CONTEXT, TRAINING_POD_SECURITY_CONTEXT, api_object, checkov_skips
from k8s.job_config import JobConfig
from k8s.launcher import FT_CONFIG_PATH, TRAIN_CONFIG_PATH, container_command, launcher_args, nvrx_ft_config
from training.contract.job_rules import JOB_RULES, DisruptionRule, ExitRule
from training.contract.launcher import DRAIN_MARKER_ENV, FIRST_ATTEMPT_NCCL_DEBUG_ENV, store_command
from training.contract.replica_groups import LIGHTHOUSE_ENV, LIGHTHOUSE_PORT, REPLICA_GROUP_ENV, lighthouse_command

CONTAINER = "trainer"
STORE_COMPONENT = "rendezvous"  # the store's app.kubernetes.io/component label, container and port name
CONFIG_COMPONENT = "config"
LIGHTHOUSE_COMPONENT = "lighthouse"
# Every replica group's training pods carry it, valued the set's name: what they may talk to across groups
# (the cross-group all-reduce, a heal's state transfer).
REPLICA_SET_LABEL = "platform.training/replica-groups"
METRICS_PATH = "/metrics"  # the ConfigMaps' app.kubernetes.io/component label: how old ones are found
# The pod's scratch (JIT and library caches: HOME points here): an emptyDir, which lives under the
# kubelet's root, on these nodes already the instance-store NVMe RAID0 (nodeadm localStorage RAID0). A
# hostPath there would outlive the pod, but nothing reads it back, and hostPath is what PSA baseline forbids.
SCRATCH_MOUNT_PATH = "/scratch"
# nvidia-container-toolkit 1.20.0, on AL2023 NVIDIA AMIs from v20260818, added a CDI hook that creates
# /etc/nvidia/nvidia-application-profiles-rc.d in every GPU container at create time and aborts the container
# when that fails on a read-only file system (awslabs/amazon-eks-ami issue 2790; NVIDIA/nvidia-container-toolkit
# issue 2026, fixed by PR 2028, in no AMI release we could name). OCI createContainer hooks run after the
# container's mounts are in place (OCI runtime spec, "createContainer Hooks"), so a writable emptyDir here
# lets the hook succeed under the read-only root on any AMI, with or without the fix.
NVIDIA_CONFIG_DIR = "/etc/nvidia"
FSX_OWNER_CONTAINER = "fsx-owner"
# The Prometheus server's pods (infra.metrics_collection, the prometheus chart's labels): the only scrapers.
PROMETHEUS_SERVER = {"app.kubernetes.io/name": "prometheus"}
# Written by the preStop hook, which the kubelet runs before it sends SIGTERM: the ranks then take
# that SIGTERM for a drain and commit before they leave (training.train.drain). In the pod's own
# memory-backed /dev/shm, so a replacement pod starts without it.
DRAIN_MARKER_PATH = "/dev/shm/training-drain"

# NoExecute taints the node controller puts on a node that stopped reporting: the pod leaves such a
# node after JobConfig.node_failure_toleration_s. The taint manager marks it DisruptionTarget, so the
# Job's podFailurePolicy does not count it against the index's retries.
NODE_FAILURE_TAINTS = ("node.kubernetes.io/unreachable", "node.kubernetes.io/not-ready")

# checkov findings that are inherent to the training image's pods, each with its reason.
IMAGE_CHECKOV_SKIPS = {
    "CKV_K8S_15": "the tag is fixed per build (CDK asset hash or the given imageUri); "
                  "IfNotPresent lets a replacement pod start without ECR",
    "CKV_K8S_43": "the ImageUri output tags the CDK asset by its content hash; its digest is not known when rendering",
}
FSX_OWNER_CHECKOV_SKIPS = dict.fromkeys(
    ("CKV_K8S_23", "CKV_K8S_25"),
    "the fsx-owner init container alone runs as root with CHOWN and FOWNER: it gives the Job's "
    "directory on FSx to the training user (Lustre has no uid mount option, the CSI driver no fsGroup)")
JOB_CHECKOV_SKIPS = {**IMAGE_CHECKOV_SKIPS, **FSX_OWNER_CHECKOV_SKIPS}
LIGHTHOUSE_CHECKOV_SKIPS = {
    "CKV_K8S_11": "a CPU limit would only throttle the Lighthouse while every group waits for its quorum",
    **IMAGE_CHECKOV_SKIPS,
}
STORE_CHECKOV_SKIPS = {
    "CKV_K8S_11": "a CPU limit would only throttle the store during a rendezvous round, "
                  "while every launcher waits on it",
    **IMAGE_CHECKOV_SKIPS,
    **FSX_OWNER_CHECKOV_SKIPS,
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
    labels = {"app.kubernetes.io/name": job.name, "app.kubernetes.io/component": CONTAINER}
    return labels if job.replica_group is None else {**labels, REPLICA_SET_LABEL: job.set_name}


def _peer_labels(job: JobConfig) -> dict[str, str]:
    """The training pods this Job's talk to on any port: its own, with replica groups every group's."""
    if job.replica_group is None:
        return _pod_labels(job)
    return {REPLICA_SET_LABEL: job.set_name, "app.kubernetes.io/component": CONTAINER}


def _lighthouse_labels(job: JobConfig) -> dict[str, str]:
    return {"app.kubernetes.io/name": job.set_name, "app.kubernetes.io/component": LIGHTHOUSE_COMPONENT}


def _store_labels(job: JobConfig) -> dict[str, str]:
    # Another component than the training pods': the Job's NetworkPolicy does not select the store.
    return {"app.kubernetes.io/name": job.name, "app.kubernetes.io/component": STORE_COMPONENT}


def _scrape_annotations(job: JobConfig) -> dict[str, dict[str, str]]:
    """The prometheus.io annotations that Prometheus' kubernetes-pods job (and the CloudWatch agent's)
    discover pods by. Every pod carries them; only the one running rank 0 answers."""
    if not job.train.metrics.port:
        return {}
    return {"annotations": {"prometheus.io/scrape": "true", "prometheus.io/port": str(job.train.metrics.port),
                            "prometheus.io/path": METRICS_PATH}}


def _node_failure_tolerations(job: JobConfig) -> list[dict]:
    return [{"key": taint, "operator": "Exists", "effect": "NoExecute",
             "tolerationSeconds": job.node_failure_toleration_s} for taint in NODE_FAILURE_TAINTS]


def efa_env(job: JobConfig) -> dict[str, str]:
    """libfabric's EFA settings for NCCL's aws-ofi-nccl plugin; none on instance types without EFA."""
    if not job.instance.efa_interfaces:
        return {}
    return {
        "FI_PROVIDER": "efa",
        "FI_EFA_USE_DEVICE_RDMA": "1",  # GPUDirect RDMA on p4d/p5
        "FI_EFA_FORK_SAFE": "1",  # data loader workers fork after EFA memory is registered
    }


def _training_env(job: JobConfig) -> list[dict[str, str]]:
    env: dict[str, str] = {
        "NCCL_DEBUG": "WARN",
        # A pod's first worker attempt logs NCCL's transport at INFO (training.train.distributed): once per
        # node, NET/OFI on EFA, NET/Socket when NCCL fell back to TCP.
        FIRST_ATTEMPT_NCCL_DEBUG_ENV: "INFO",
        "NCCL_DEBUG_SUBSYS": "INIT,NET",
        # Flight recorder: the last collectives of each rank, dumped on a watchdog timeout to the run
        # directory on FSx, where they outlive the pod (NVRx fault attribution reads them).
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(PurePosixPath(job.train.run_dir) / "nccl_trace_rank_"),
        DRAIN_MARKER_ENV: DRAIN_MARKER_PATH,
        # The root filesystem is read-only: CUDA's, Triton's and the libraries' caches under HOME go to
        # the scratch emptyDir, TorchInductor's and NVRx's sockets to /tmp (another emptyDir).
        "HOME": SCRATCH_MOUNT_PATH,
    }
    env |= efa_env(job)
    if job.replica_group is not None:  # read by training.train.replica_groups; torchft's Manager on group rank 0
        env |= {REPLICA_GROUP_ENV: str(job.replica_group), LIGHTHOUSE_ENV: job.lighthouse_endpoint}
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


def gpu_pod_resources(job: JobConfig) -> dict[str, str]:
    """A whole GPU node: its GPUs, EFA interfaces and EFA's huge pages; requests equal limits."""
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


def fsx_mounts(job: JobConfig, *, read_only: bool) -> list[dict]:
    """The Job's own directory on FSx (its run_dir, checkpoints inside), mounted by subPath at the same
    path: a pod never sees the rest of the file system, another Job's checkpoints included. Write access
    to it is code execution in every rank on resume: DCP's .metadata and non-tensor items are pickles that
    dcp.load unpickles. The token file's directory, when on FSx, comes read-only."""
    mounts = [{"name": "fsx", "mountPath": job.train.run_dir, "subPath": job.job_dir, "readOnly": read_only}]
    if job.data_dir is not None:
        mounts.append({"name": "fsx", "mountPath": str(PurePosixPath(CHECKPOINT_MOUNT_PATH) / job.data_dir),
                       "subPath": job.data_dir, "readOnly": True})
    return mounts


def resume_mounts(job: JobConfig) -> list[dict]:
    """The other checkpoint directories a resume reads (checkpoint.also_resume_from: the other replica
    groups'), read-only: a group writes only its own."""
    return [{"name": "fsx", "mountPath": path, "subPath": str(PurePosixPath(path).relative_to(CHECKPOINT_MOUNT_PATH)),
             "readOnly": True} for path in job.train.checkpoint.also_resume_from]


def _fsx_owner_container(job: JobConfig) -> dict:
    """Creates the Job's directory on FSx and gives it to the training user, mode 0700, before the trainer
    starts; the one root process of the pod, with CHOWN and FOWNER only, running this command only. Lustre
    has no uid/gid mount option, and the FSx CSI driver applies no fsGroup to a ReadWriteMany volume. The
    directories of `resume_mounts` too: a subPath that does not exist yet the kubelet would make root's."""
    owner = f"{TRAINING_UID}:{TRAINING_UID}"
    command = " && ".join(f"mkdir -p {path} && chown {owner} {path} && chmod 0700 {path}" for path in
                          map(shlex.quote, (job.train.run_dir, *job.train.checkpoint.also_resume_from)))
    return {
        "name": FSX_OWNER_CONTAINER,
        "image": job.infra.image_uri,
        "imagePullPolicy": "IfNotPresent",
        "command": ["/bin/sh", "-c", command],
        "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}, "limits": {"cpu": "1", "memory": "256Mi"}},
        "securityContext": {**CONTAINER_SECURITY_CONTEXT, "runAsNonRoot": False, "runAsUser": 0, "runAsGroup": 0,
                            "capabilities": {"drop": ["ALL"], "add": ["CHOWN", "FOWNER"]}},
        "volumeMounts": [{"name": "fsx", "mountPath": CHECKPOINT_MOUNT_PATH}],
    }


def _pod_spec(job: JobConfig) -> dict:
    mounts = [
        *fsx_mounts(job, read_only=False),
        *resume_mounts(job),
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "scratch", "mountPath": SCRATCH_MOUNT_PATH},
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "nvidia-config", "mountPath": NVIDIA_CONFIG_DIR},
    ]
    config_files = _config_files(job)
    mounts += [{"name": f.volume, "mountPath": str(PurePosixPath(f.path).parent), "readOnly": True}
               for f in config_files]
    volumes = [
        {"name": "fsx", "persistentVolumeClaim": {"claimName": job.infra.pvc_name}},
        # NCCL and the data loaders share memory through /dev/shm; the container default is 64 MiB.
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{job.shm_gib}Gi"}},
        {"name": "scratch", "emptyDir": {"sizeLimit": "100Gi"}},
        {"name": "tmp", "emptyDir": {"sizeLimit": "10Gi"}},
        {"name": "nvidia-config", "emptyDir": {"sizeLimit": "16Mi"}},
    ]
    volumes += [{"name": f.volume, "configMap": {"name": f.config_map}} for f in config_files]
    resources = gpu_pod_resources(job)
    container = {
        "name": CONTAINER,
        "image": job.infra.image_uri,
        "imagePullPolicy": "IfNotPresent",
        "command": container_command(job.train.fault_tolerance),
        "args": launcher_args(job),
        "env": _training_env(job),
        "resources": {"requests": resources, "limits": resources},
        "securityContext": dict(CONTAINER_SECURITY_CONTEXT),
        "volumeMounts": mounts,
        "lifecycle": {"preStop": {"exec": {"command": ["/bin/sh", "-c", f"touch {DRAIN_MARKER_PATH}"]}}},
    }
    # torchft advertises socket.gethostname() to the other groups for its Manager and a heal's HTTP transfer
    # (torchft 0.2.0 manager.py, checkpointing/http_transport.py): with replica groups the hostname is the
    # pod's FQDN, which resolves in every pod (Kubernetes docs, "Pod's setHostnameAsFQDN field").
    fqdn = {"setHostnameAsFQDN": True} if job.replica_group is not None else {}
    return {
        "restartPolicy": "Never",  # the Job replaces failed pods (podFailurePolicy needs Never)
        "subdomain": job.service_name,
        **fqdn,
        "serviceAccountName": SERVICE_ACCOUNT,
        "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": job.grace_period_s,
        # Requesting all GPUs of the instance type already means one pod per node.
        "nodeSelector": {"node.kubernetes.io/instance-type": job.instance.name, GPU_NODE_LABEL: "true"},
        "tolerations": [
            {"key": GPU_TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"},
            *_node_failure_tolerations(job),
        ],
        "securityContext": dict(TRAINING_POD_SECURITY_CONTEXT),
        "initContainers": [_fsx_owner_container(job)],
        "containers": [container],
        "volumes": volumes,
    }


def _job_spec(job: JobConfig) -> dict:
    return {
        "completionMode": "Indexed",
        # Spares are indexes too: each runs a standby ft_launcher that takes a lost node's place in the
        # next rendezvous round, and the lost node's replacement pod becomes the new standby.
        "completions": job.pods,
        "parallelism": job.pods,
        # One index out of retries fails the Job at once and stops its pods.
        "backoffLimitPerIndex": job.backoff_limit_per_index,
        "maxFailedIndexes": 0,
        # A replacement starts only once the old pod is gone: no two pods share a hostname.
        "podReplacementPolicy": "Failed",
        "ttlSecondsAfterFinished": job.ttl_seconds_after_finished,
        # The table the local cluster decides by: disruptions ignored, config errors and restarts
        # without progress fail the Job.
        "podFailurePolicy": {"rules": [_pod_failure_rule(rule) for rule in JOB_RULES]},
        # job_rules.job_succeeded: as many pods as training nodes exited 0, the run completed; the rest linger
        "successPolicy": {"rules": [{"succeededCount": job.nodes}]},
        "template": {
            "metadata": {"labels": _pod_labels(job), **_scrape_annotations(job)},
            "spec": _pod_spec(job),
        },
    }


def _pod_failure_rule(rule: DisruptionRule | ExitRule) -> dict:
    """One rule of the table, as the batch/v1 Job spec spells it."""
    if isinstance(rule, DisruptionRule):
        return {"action": rule.action.value, "onPodConditions": [{"type": rule.condition, "status": "True"}]}
    return {"action": rule.action.value, "onExitCodes": {"containerName": CONTAINER, "operator": "In",
                                                         "values": list(rule.exit_codes)}}


def _store_container(job: JobConfig, train_config: _ConfigFile) -> dict:
    port = {"port": STORE_COMPONENT}
    return {
        "name": STORE_COMPONENT,
        "image": job.infra.image_uri,  # nvrx-control is the image's NVRx console script
        "imagePullPolicy": "IfNotPresent",
        # training.pod.store starts nvrx-control over when the run stalls with no node left to open a round
        "command": ["python", "-m", "training.pod.store", "--config", train_config.path, "--",
                    *store_command(job.train.fault_tolerance, RENDEZVOUS_PORT, job.name, job.nodes, job.spares,
                                  job.lost_pod_replaced_s)],
        "ports": [{"name": STORE_COMPONENT, "containerPort": RENDEZVOUS_PORT}],
        # A TCPStore of a few dozen nodes holds kilobytes: the Python process (torch imported) is the cost.
        "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"memory": "2Gi"}},
        "readinessProbe": {"tcpSocket": port, "periodSeconds": 5},
        # Lenient: a restart loses the rendezvous state (see _store_pod_spec).
        "livenessProbe": {"tcpSocket": port, "periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 6},
        "securityContext": dict(CONTAINER_SECURITY_CONTEXT),
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"},
                         # the run's event log, read to tell a stalled run (training.pod.store)
                         *fsx_mounts(job, read_only=True)[:1],
                         {"name": train_config.volume, "mountPath": str(PurePosixPath(train_config.path).parent),
                          "readOnly": True}],
    }


def _store_pod_spec(job: JobConfig) -> dict:
    """nvrx-control owns the c10d store and closes every rendezvous round; every ft_launcher is its
    client (is_host=false), so losing any GPU node, index 0's too, costs the same one restart.

    The store keeps the rendezvous state in memory: restarted mid-run it has lost it, the launchers
    fail and their pods are retried (counted against backoffLimitPerIndex). Hence the stable
    on-demand system nodes, never a GPU node (no GPU toleration), and a short stay on a lost node,
    like the training pods'.

    The store mounts the Job's directory read-only by subPath; on a read-only volume the kubelet cannot
    create a missing subPath ("failed to create subPath directory … read-only file system",
    kubernetes/kubernetes PR 65241) and the pod waits in CreateContainerConfigError. On a fresh run the
    store may start before any trainer's init container made the directory, so it runs the same fsx-owner
    init container (init containers finish before the kubelet prepares the store's mounts); the volume is
    writable for that container only, the store's own mount is read-only.
    """
    train_config = _config_files(job)[0]
    return {
        "automountServiceAccountToken": False,  # it never calls the Kubernetes API
        "nodeSelector": {SYSTEM_NODE_LABEL: "true"},
        "tolerations": _node_failure_tolerations(job),
        "securityContext": dict(TRAINING_POD_SECURITY_CONTEXT),
        "initContainers": [_fsx_owner_container(job)],
        "containers": [_store_container(job, train_config)],
        # Python's tempfile module probes for a writable directory (torch's import uses it): the root
        # filesystem is read-only.
        "volumes": [{"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}},
                    {"name": "fsx", "persistentVolumeClaim": {"claimName": job.infra.pvc_name}},
                    {"name": train_config.volume, "configMap": {"name": train_config.config_map}}],
    }


def _store_deployment_spec(job: JobConfig) -> dict:
    """A Deployment restarts the store if its node dies. nvrx-control exits 0 when the rendezvous shuts
    down (the run ended, or a launcher stopped for good); the Deployment then starts it again with an
    empty store that no launcher uses: harmless. A new run is `kubectl delete -f
    dist/training.k8s.yaml` and apply: a fresh Job and a fresh store."""
    labels = _store_labels(job)
    return {
        "replicas": 1,
        "strategy": {"type": "Recreate"},  # a rollout never runs two stores, which would split the launchers
        "selector": {"matchLabels": labels},
        "template": {"metadata": {"labels": labels}, "spec": _store_pod_spec(job)},
    }


def _rendezvous_store(chart: Construct, job: JobConfig) -> None:
    """The store's Deployment, the Service the launchers reach it by (JobConfig.rendezvous_endpoint),
    and ingress to it on the rendezvous port from the training pods only: the c10d store has no
    authentication and every launcher unpickles its rendezvous state. It connects to nothing."""
    ns, labels = job.namespace, _store_labels(job)
    api_object(chart, "rendezvous", api_version="apps/v1", kind="Deployment", name=job.store_name, namespace=ns,
               annotations=checkov_skips(STORE_CHECKOV_SKIPS), body={"spec": _store_deployment_spec(job)})
    api_object(chart, "rendezvous-service", api_version="v1", kind="Service", name=job.store_name, namespace=ns,
               body={"spec": {"type": "ClusterIP", "selector": labels, "ports": [
                   {"name": STORE_COMPONENT, "port": RENDEZVOUS_PORT, "targetPort": STORE_COMPONENT}]}})
    network_policy(chart, "rendezvous-network-policy", job, job.store_name, labels,
                   ingress=[{"from": [pods(_pod_labels(job))], "ports": [{"protocol": "TCP", "port": RENDEZVOUS_PORT}]}])


def _training_network_policy(chart: Construct, job: JobConfig) -> None:
    """The training pods talk among themselves on any port (the ranks' c10d store, gloo and NCCL
    bootstrap sockets, peer state; with replica groups every group's pods, for the cross-group all-reduce
    and a heal), reach the store on the rendezvous port (the launchers' rendezvous, and with restart=both
    the in-process Wrapper's coordination: training.train.coordination), the Lighthouse with replica groups,
    and DNS, and let the Prometheus server in on the metrics port; nothing else in or out."""
    labels = _pod_labels(job)
    egress = [{"to": [pods(_store_labels(job))], "ports": [{"protocol": "TCP", "port": RENDEZVOUS_PORT}]}]
    if job.replica_group is not None:
        egress.append({"to": [pods(_lighthouse_labels(job))], "ports": [{"protocol": "TCP", "port": LIGHTHOUSE_PORT}]})
    rules = among_themselves(_peer_labels(job), egress=tuple(egress))
    if job.train.metrics.port:
        rules["ingress"].append({
            "from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": MONITORING_NAMESPACE}},
                      "podSelector": {"matchLabels": PROMETHEUS_SERVER}}],
            "ports": [{"protocol": "TCP", "port": job.train.metrics.port}]})
    network_policy(chart, "network-policy", job, job.name, labels, **rules)


def _lighthouse(chart: Chart, job: JobConfig) -> None:
    """torchft's Lighthouse for every replica group: a Deployment on the system nodes, like the stores, its
    Service, and ingress from the training pods on its port only. Restarted within parallel.quorum_timeout_s,
    it restarts no group: their ManagerServers ask it again for a quorum every second."""
    ns, labels, port = job.namespace, _lighthouse_labels(job), {"port": LIGHTHOUSE_COMPONENT}
    container = {
        "name": LIGHTHOUSE_COMPONENT,
        "image": job.infra.image_uri,  # torchft_lighthouse is the image's torchft console script
        "imagePullPolicy": "IfNotPresent",
        # on the pod's IPv4 address: EKS gives pods IPv4 addresses in an IPv4 cluster (infra.cluster)
        "command": lighthouse_command(job.train.parallel.lighthouse_options(), LIGHTHOUSE_PORT, host="0.0.0.0"),
        "ports": [{"name": LIGHTHOUSE_COMPONENT, "containerPort": LIGHTHOUSE_PORT}],
        # its console script imports torchft, and with it torch: the Python process is the cost
        "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"memory": "2Gi"}},
        "readinessProbe": {"tcpSocket": port, "periodSeconds": 5},
        "livenessProbe": {"tcpSocket": port, "periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 6},
        "securityContext": dict(CONTAINER_SECURITY_CONTEXT),
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
    }
    spec = {
        "automountServiceAccountToken": False,  # it never calls the Kubernetes API
        "nodeSelector": {SYSTEM_NODE_LABEL: "true"},
        "tolerations": _node_failure_tolerations(job),
        "securityContext": dict(TRAINING_POD_SECURITY_CONTEXT),
        "containers": [container],
        "volumes": [{"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}}],  # Python's tempfile probe
    }
    api_object(chart, "lighthouse", api_version="apps/v1", kind="Deployment", name=job.lighthouse_name, namespace=ns,
               annotations=checkov_skips(LIGHTHOUSE_CHECKOV_SKIPS), body={"spec": {
                   "replicas": 1, "strategy": {"type": "Recreate"},  # never two quorums
                   "selector": {"matchLabels": labels},
                   "template": {"metadata": {"labels": labels}, "spec": spec}}})
    api_object(chart, "lighthouse-service", api_version="v1", kind="Service", name=job.lighthouse_name, namespace=ns,
               body={"spec": {"type": "ClusterIP", "selector": labels, "ports": [
                   {"name": LIGHTHOUSE_COMPONENT, "port": LIGHTHOUSE_PORT, "targetPort": LIGHTHOUSE_COMPONENT}]}})
    network_policy(chart, "lighthouse-network-policy", job, job.lighthouse_name, labels,
                   ingress=[{"from": [pods(_peer_labels(job.group(0)))],
                             "ports": [{"protocol": "TCP", "port": LIGHTHOUSE_PORT}]}])


def _training_job(scope: Construct, job: JobConfig) -> None:
    """One Job's objects: its store, headless Service, config maps, network policy and the Job."""
    ns = job.namespace
    _rendezvous_store(scope, job)
    # Headless: the DNS names <job>-<index>.<service> that are the pods' FQDNs, which ft_launcher
    # hands its ranks as MASTER_ADDR (rank 0's, with a free port of its own); no ports, no load
    # balancing.
    api_object(scope, "service", api_version="v1", kind="Service", name=job.service_name, namespace=ns, body={
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,  # names resolve from the pod's start
            "selector": {"batch.kubernetes.io/job-name": job.name},
        }})
    for f in _config_files(job):
        api_object(scope, f.volume, api_version="v1", kind="ConfigMap", name=f.config_map, namespace=ns,
                   labels={"app.kubernetes.io/component": CONFIG_COMPONENT},
                   body={"immutable": True, "data": f.data})
    _training_network_policy(scope, job)
    api_object(scope, "job", api_version="batch/v1", kind="Job", name=job.name, namespace=ns,
               annotations=checkov_skips(JOB_CHECKOV_SKIPS), body={"spec": _job_spec(job)})


class TrainingChart(Chart):
    def __init__(self, scope: Construct, id: str, job: JobConfig) -> None:
        super().__init__(scope, id, labels={"app.kubernetes.io/name": job.name,
                                            "app.kubernetes.io/part-of": job.infra.cluster_name})
        if not job.is_group_set:
            _training_job(self, job)
            return
        _lighthouse(self, job)
        for group in job.groups:
            _training_job(Construct(self, f"group{group.replica_group}"), group)
