"""What `make manifests` writes: Kubernetes 1.34 schemas (strict) and the Job's fault-tolerance settings."""
from __future__ import annotations

import copy

import kubernetes_validate
import pytest
import yaml

from infra.config import (CHECKPOINT_MOUNT_PATH, GPU_NODE_LABEL, GPU_TAINT_KEY, NAMESPACE, PVC_NAME,
                          RENDEZVOUS_PORT, SERVICE_ACCOUNT, SYSTEM_NODE_LABEL, PlatformConfig)
from infra.instances import INSTANCE_TYPES
from k8s.job_config import LAUNCHER_EXIT_MARGIN_S
from k8s.launcher import FT_CONFIG_PATH, TRAIN_CONFIG_PATH
from k8s.outputs import PLACEHOLDER_IMAGE
from training.contract.config import RESTART_MODES
from training.contract.exit_codes import CONFIG_ERROR, INCOMPLETE, NO_PROGRESS, TERMINATED
from training.contract.job_rules import JOB_RULES, Decision, FailReason, Outcome, PodEnd, decide, job_succeeded

from k8s_render import IMAGE, fitting, render_into

K8S_VERSION = f"{PlatformConfig().kubernetes_version}.0"  # the schemas of the default cluster


@pytest.mark.parametrize("instance_type", sorted(INSTANCE_TYPES))
@pytest.mark.parametrize("mode", RESTART_MODES)
def test_every_manifest_validates_strictly_against_kubernetes_1_34(render, mode, instance_type):
    r = render("--fault-injection", "--set", f"fault_tolerance.restart={mode}", *fitting(instance_type),
               context={"gpuInstanceType": instance_type})
    assert sorted(r.files) == ["hung-node-marker.k8s.yaml", "network-defaults.k8s.yaml", "service-account.k8s.yaml",
                               "training-fault-injection.k8s.yaml", "training.k8s.yaml"]
    for obj in r.objects():
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)  # raises ValidationError


def test_strict_validation_rejects_an_unknown_field(render):
    job = copy.deepcopy(render().one("Job"))
    job["spec"]["template"]["spec"]["containers"][0]["gpus"] = 8
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, K8S_VERSION, strict=True)


def test_job_is_indexed_one_pod_per_node_and_spare_with_a_per_index_retry_budget(render):
    spec = render("--nodes", "3").one("Job")["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == 3 + 1  # the default spare, within gpuNodesMax=4
    assert spec["backoffLimitPerIndex"] >= 1 and spec["maxFailedIndexes"] == 0
    assert "backoffLimit" not in spec  # with backoffLimitPerIndex it is the per-index budget that counts
    assert spec["podReplacementPolicy"] == "Failed"
    assert spec["ttlSecondsAfterFinished"] > 0
    assert spec["template"]["spec"]["restartPolicy"] == "Never"


def _store(r) -> dict:
    store = r.store
    return store


def _store_argv(r) -> list[str]:
    (container,) = _store(r)["spec"]["template"]["spec"]["containers"]
    return container["command"]


@pytest.mark.parametrize("args, context, nodes, spares", [
    ([], {}, 2, 1),  # gpuNodesDesired=2 and, below gpuNodesMax=4, one spare
    ([], {"gpuNodesDesired": 3}, 3, 1),
    ([], {"gpuNodesDesired": 4}, 4, 0),  # no room below gpuNodesMax
    ([], {"gpuNodesSpare": 2}, 2, 2),
    (["--spares", "0"], {}, 2, 0),
    (["--nodes", "1", "--spares", "3"], {}, 1, 3),
])
def test_training_nodes_and_spares_are_the_platforms_unless_given(render, args, context, nodes, spares):
    r = render(*args, context=context)
    spec = r.one("Job")["spec"]
    assert spec["completions"] == spec["parallelism"] == nodes + spares
    # The store and every launcher agree: `nodes` train, up to `spares` more stand by.
    assert f"--nnodes={nodes}:{nodes + spares}" in r.container["args"]
    assert f"--nnodes={nodes}:{nodes + spares}" in _store_argv(r)
    assert f"job fsdp-train: {nodes} x p5.48xlarge + {spares} spare" in r.stdout
    assert ("96.4 GB per save to FSx 1200 GiB x 1000 MBps/TiB = 1.17 GB/s in 82 s, interval 200 steps ~ 213 s, "
            "drain grace 360 s") in r.stdout


def test_pod_failure_policy_ignores_disruptions_and_fails_fast_on_config_errors_and_no_progress(render):
    rules = render().one("Job")["spec"]["podFailurePolicy"]["rules"]
    assert {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]} in rules
    assert {"action": "FailJob", "onExitCodes": {"containerName": "trainer", "operator": "In",
                                                 "values": [CONFIG_ERROR, NO_PROGRESS]}} in rules
    # A launcher that left before the run completed (a standby, a clean stop) is retried.
    assert not [rule for rule in rules if rule["action"] == "FailJob" and INCOMPLETE in rule["onExitCodes"]["values"]]


def test_pod_failure_policy_is_the_table_the_local_cluster_decides_by(render):
    rules = render().one("Job")["spec"]["podFailurePolicy"]["rules"]
    assert [rule["action"] for rule in rules] == [rule.action.value for rule in JOB_RULES]
    fail_job_codes = [code for rule in rules if rule["action"] == "FailJob" for code in rule["onExitCodes"]["values"]]
    assert fail_job_codes and all(decide(PodEnd(code, disrupted=False, retries_used=0), 3, survivor=True)
                                  == Decision(Outcome.FAIL_JOB, reason=FailReason.EXIT_CODE) for code in fail_job_codes)
    # what the chart ignores, the local cluster replaces without counting: a drained launcher
    ignored = [r["onPodConditions"] for r in rules if r["action"] == "Ignore"]
    assert ignored == [[{"type": "DisruptionTarget", "status": "True"}]]
    assert decide(PodEnd(TERMINATED, disrupted=True, retries_used=3), 3, survivor=True) == Decision(Outcome.REPLACE)


@pytest.mark.parametrize("nodes, spares", [(2, 1), (3, 0), (1, 3)])
def test_the_job_succeeds_once_its_training_nodes_did_as_the_local_cluster_decides(render, nodes, spares):
    spec = render("--nodes", str(nodes), "--spares", str(spares)).one("Job")["spec"]
    [rule] = spec["successPolicy"]["rules"]
    assert rule == {"succeededCount": nodes} and nodes <= spec["completions"]
    # a lost node's replacement still pending, or a spare that never trained, does not hold the Job
    assert job_succeeded(rule["succeededCount"], nodes) and not job_succeeded(rule["succeededCount"] - 1, nodes)


def _services(r) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in r.objects() if o["kind"] == "Service"}


def test_headless_service_names_the_pods_and_the_store_service_is_the_rendezvous_endpoint(render):
    r = render()
    job, services = r.one("Job"), _services(r)
    svc, store_svc = services["fsdp-train"], services["fsdp-train-rendezvous"]
    # Pod DNS names (ft_launcher's MASTER_ADDR for the ranks); no pod listens on a fixed port.
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["spec"]["selector"] == {"batch.kubernetes.io/job-name": job["metadata"]["name"]}
    assert "ports" not in svc["spec"] and "ports" not in r.container
    assert r.pod["subdomain"] == svc["metadata"]["name"]
    # Every launcher, of every index, reaches the store through its Service.
    store_labels = _store(r)["spec"]["template"]["metadata"]["labels"]
    assert store_svc["spec"]["type"] == "ClusterIP" and store_svc["spec"]["selector"] == store_labels
    assert store_svc["spec"]["ports"] == [{"name": "rendezvous", "port": RENDEZVOUS_PORT, "targetPort": "rendezvous"}]
    host = f"{store_svc['metadata']['name']}.{NAMESPACE}.svc.cluster.local"
    assert f"--rdzv-endpoint={host}:{RENDEZVOUS_PORT}" in r.container["args"]
    [conf] = [a.removeprefix("--rdzv-conf=") for a in r.container["args"] if a.startswith("--rdzv-conf=")]
    assert dict(kv.split("=") for kv in conf.split(",")) == {
        "join_timeout": "1800", "is_host": "false", "last_call_timeout": "1", "store_connect_wait_seconds": "1800"}


def test_rendezvous_store_is_one_nvrx_control_on_the_system_nodes(render):
    r = render("--node-failure-toleration", "45")
    store = _store(r)
    spec, pod = store["spec"], store["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert store["metadata"]["name"] == "fsdp-train-rendezvous" and store["metadata"]["namespace"] == NAMESPACE
    assert spec["replicas"] == 1 and spec["strategy"] == {"type": "Recreate"}  # never two stores
    assert spec["selector"]["matchLabels"] == spec["template"]["metadata"]["labels"]
    assert container["image"] == r.container["image"]
    assert container["command"][:3] == ["python", "-m", "training.pod.store"] and "nvrx-control" in container["command"]
    # it reads the run's event log (read-only, the run's directory alone) and the config the trainers run with
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    run_dir = f"{CHECKPOINT_MOUNT_PATH}/runs/fsdp-train"
    assert mounts[run_dir]["readOnly"] and mounts[run_dir]["subPath"] == "runs/fsdp-train"
    assert mounts["/etc/training"]["readOnly"] and CHECKPOINT_MOUNT_PATH not in mounts
    volumes = {v["name"]: v for v in pod["volumes"]}
    # writable for the fsx-owner init container only (tests/k8s/test_k8s_security.py)
    assert volumes[mounts[run_dir]["name"]]["persistentVolumeClaim"] == {"claimName": PVC_NAME}
    config = r.config_map_object("fsdp-train-config")["metadata"]["name"]
    assert volumes[mounts["/etc/training"]["name"]]["configMap"]["name"] == config
    assert "--rdzv-id=fsdp-train" in container["command"] and "--rdzv-id=fsdp-train" in r.container["args"]
    assert container["ports"] == [{"name": "rendezvous", "containerPort": RENDEZVOUS_PORT}]
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["tcpSocket"] == {"port": "rendezvous"}
    # On the stable system nodes, never a GPU node: no GPU toleration; off a lost node as fast as the trainers.
    assert pod["nodeSelector"] == {SYSTEM_NODE_LABEL: "true"}
    assert not [t for t in pod["tolerations"] if t["key"] == GPU_TAINT_KEY]
    assert {t["key"]: t["tolerationSeconds"] for t in pod["tolerations"]} == {
        "node.kubernetes.io/unreachable": 45, "node.kubernetes.io/not-ready": 45}
    assert "nvidia.com/gpu" not in container["resources"]["limits"]
    assert pod["automountServiceAccountToken"] is False
    assert pod["securityContext"] == r.pod["securityContext"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert {"allowPrivilegeEscalation", "capabilities"} <= set(container["securityContext"])


def test_config_maps_carry_the_training_config_rooted_on_fsx(render):
    r = render("--set", "checkpoint.interval=500")
    train = yaml.safe_load(r.config_map("fsdp-train-config")["config.yaml"])
    assert train["checkpoint"]["interval"] == 500
    assert train["run_dir"] == f"{CHECKPOINT_MOUNT_PATH}/runs/fsdp-train"
    ft = yaml.safe_load(r.config_map("fsdp-train-ft-config")["ft.yaml"])["fault_tolerance"]
    assert ft["rank_section_timeouts"]["checkpoint"] == train["fault_tolerance"]["checkpoint_section_timeout"]
    mounts = {m["name"]: m["mountPath"] for m in r.container["volumeMounts"]}
    volumes = {v["name"]: v for v in r.pod["volumes"]}
    assert volumes["train-config"]["configMap"]["name"] == r.config_map_object("fsdp-train-config")["metadata"]["name"]
    assert f"{mounts['train-config']}/config.yaml" == TRAIN_CONFIG_PATH
    assert volumes["ft-config"]["configMap"]["name"] == r.config_map_object("fsdp-train-ft-config")["metadata"]["name"]
    assert f"{mounts['ft-config']}/ft.yaml" == FT_CONFIG_PATH


def _config_map_names(r) -> dict[str, str]:
    return {prefix: r.config_map_object(prefix)["metadata"]["name"]
            for prefix in ("fsdp-train-config", "fsdp-train-ft-config")}


def test_config_maps_are_immutable_and_named_after_their_content(render):
    r = render()
    for name in _config_map_names(r).values():
        (config_map,) = [o for o in r.objects() if o["metadata"]["name"] == name]
        # apply cannot change a running Job's config; `-l` finds the old ones to delete
        assert config_map["immutable"] is True
        assert config_map["metadata"]["labels"]["app.kubernetes.io/component"] == "config"
        assert config_map["metadata"]["labels"]["app.kubernetes.io/name"] == "fsdp-train"
    assert _config_map_names(render()) == _config_map_names(r)  # stable for the same config
    # A training setting changes the training config's name only; an NVRx timeout both (both files carry it).
    interval = _config_map_names(render("--set", "checkpoint.interval=500"))
    assert interval["fsdp-train-config"] != _config_map_names(r)["fsdp-train-config"]
    assert interval["fsdp-train-ft-config"] == _config_map_names(r)["fsdp-train-ft-config"]
    timeout = _config_map_names(render("--set", "fault_tolerance.rank_heartbeat_timeout=120"))
    assert not set(timeout.values()) & set(_config_map_names(r).values())


def test_relative_checkpoint_dir_lands_under_the_run_dir_on_fsx(render):
    cfg = yaml.safe_load(render("--set", "checkpoint.dir=ckpt").config_map("fsdp-train-config")["config.yaml"])
    assert cfg["checkpoint"]["dir"] == f"{CHECKPOINT_MOUNT_PATH}/runs/fsdp-train/ckpt"


@pytest.mark.parametrize("instance_type", sorted(INSTANCE_TYPES))
def test_resources_come_from_the_instance_table_with_requests_equal_to_limits(render, instance_type):
    facts = INSTANCE_TYPES[instance_type]
    r = render(*fitting(instance_type), context={"gpuInstanceType": instance_type})
    resources = r.container["resources"]
    assert resources["requests"] == resources["limits"]
    got = resources["limits"]
    assert got["nvidia.com/gpu"] == str(facts.gpus)
    assert got["memory"] == f"{facts.pod_memory_gib}Gi"
    assert got.get("vpc.amazonaws.com/efa") == (str(facts.efa_interfaces) if facts.efa_interfaces else None)
    assert got.get("hugepages-2Mi") == (f"{facts.hugepages_2mi_gib}Gi" if facts.hugepages_2mi_gib else None)
    assert 0 < int(got["cpu"]) < facts.vcpus
    assert r.pod["nodeSelector"] == {"node.kubernetes.io/instance-type": instance_type, GPU_NODE_LABEL: "true"}
    efa_env = {"FI_PROVIDER", "FI_EFA_USE_DEVICE_RDMA", "FI_EFA_FORK_SAFE"}
    assert (efa_env <= set(r.env)) == bool(facts.efa_interfaces)


def test_volumes_the_jobs_fsx_directory_shared_memory_and_scratch(render):
    r = render()
    volumes = {v["name"]: v for v in r.pod["volumes"]}
    mounts = {m["name"]: m for m in r.container["volumeMounts"]}
    assert volumes["fsx"]["persistentVolumeClaim"] == {"claimName": PVC_NAME}
    # the Job's own directory, at its run_dir: never the FSx root
    assert (mounts["fsx"]["mountPath"], mounts["fsx"]["subPath"]) == (f"{CHECKPOINT_MOUNT_PATH}/runs/fsdp-train",
                                                                      "runs/fsdp-train")
    mounts = {name: m["mountPath"] for name, m in mounts.items()}
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory" and volumes["dshm"]["emptyDir"]["sizeLimit"].endswith("Gi")
    assert mounts["dshm"] == "/dev/shm"
    # emptyDirs (on the kubelet's NVMe RAID0) for what the read-only root cannot take: caches under HOME, /tmp
    assert "emptyDir" in volumes["scratch"] and "emptyDir" in volumes["tmp"]
    assert mounts["tmp"] == "/tmp" and r.env["HOME"] == mounts["scratch"]
    assert not [v for o in r.objects() for v in _pod_spec_of(o).get("volumes", []) if "hostPath" in v]


def test_pod_tolerates_the_gpu_taint_and_runs_as_the_service_account(render):
    r = render()
    assert {"key": GPU_TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"} in r.pod["tolerations"]
    assert r.pod["serviceAccountName"] == SERVICE_ACCOUNT
    assert r.pod["automountServiceAccountToken"] is False


@pytest.mark.parametrize("args, seconds", [([], 30), (["--node-failure-toleration", "60"], 60)])
def test_pod_leaves_an_unreachable_or_not_ready_node_after_a_short_toleration(render, args, seconds):
    # Not the 300 s the admission plugin adds to pods that do not say: a lost node's pod is replaced sooner.
    tolerations = render(*args).pod["tolerations"]
    for taint in ("node.kubernetes.io/unreachable", "node.kubernetes.io/not-ready"):
        assert {"key": taint, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": seconds} in tolerations
    assert len(tolerations) == 3  # with the GPU taint's


def test_grace_period_covers_the_drain(render):
    r = render("--set", "fault_tolerance.drain_timeout_s=900")
    # ft_launcher waits this long for its ranks to commit after SIGTERM, the kubelet a margin longer
    assert "--term-timeout=900.0" in r.container["args"]
    assert r.pod["terminationGracePeriodSeconds"] == 900 + LAUNCHER_EXIT_MARGIN_S


@pytest.mark.parametrize("mode", RESTART_MODES)
def test_restart_mode_sets_the_nccl_environment_and_restart_budget(render, mode):
    r = render("--set", f"fault_tolerance.restart={mode}", "--set", "fault_tolerance.max_restarts=7")
    env = r.env
    assert env["TORCH_NCCL_TRACE_BUFFER_SIZE"] != "0"
    if mode == "injob":
        assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
        assert "NCCL_NVLS_ENABLE" not in env and "TORCH_NCCL_RETHROW_CUDA_ERRORS" not in env
    else:
        assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"
        assert env["NCCL_NVLS_ENABLE"] == "0"
        assert env["TORCH_NCCL_RETHROW_CUDA_ERRORS"] == "0"
    # in every mode the launcher restarts what the Wrapper cannot handle: 7 restarts in a row without
    # progress, under the lifetime backstop
    assert "--max-restarts=1000" in r.container["args"]
    assert "--ft-max-no-progress-cycles=7" in r.container["args"]


def test_fault_injection_is_off_by_default_and_stale_files_are_removed(tmp_path, capsys):
    on = render_into(tmp_path / "same", capsys, "--fault-injection")
    assert "training-fault-injection.k8s.yaml" in on.files
    off = render_into(tmp_path / "same", capsys)
    assert "training-fault-injection.k8s.yaml" not in off.files
    assert "fault injection off" in off.stdout


def test_fault_injection_evicts_one_index_with_eviction_only_rights(render):
    r = render("--fault-injection", "--nodes", "3", "--fault-target-index", "0", "--fault-schedule", "*/20 * * * *")
    cron, role, binding = r.one("CronJob"), r.one("Role"), r.one("RoleBinding")
    assert cron["spec"]["schedule"] == "*/20 * * * *"
    assert cron["metadata"]["namespace"] == role["metadata"]["namespace"] == NAMESPACE
    # Evicted, not deleted: the pod gets DisruptionTarget, which the Job's podFailurePolicy ignores.
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]},
                             {"apiGroups": [""], "resources": ["pods/eviction"], "verbs": ["create"]}]
    pod = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": pod["serviceAccountName"],
                                    "namespace": NAMESPACE}]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    python, flag, script, *args = pod["containers"][0]["command"]
    assert (python, flag) == ("python", "-c") and "/eviction" in script and '"kind": "Eviction"' in script
    assert args == [NAMESPACE, "batch.kubernetes.io/job-name=fsdp-train,batch.kubernetes.io/job-completion-index=0", "1"]
    # Default target: any index, the rendezvous host included.
    default = render("--fault-injection").one("CronJob")["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    assert default["containers"][0]["command"][3:] == [NAMESPACE, "batch.kubernetes.io/job-name=fsdp-train", "1"]


def test_outputs_file_supplies_image_namespace_and_pvc(render):
    outputs = {"s1": {"ClusterName": "c", "Namespace": "ml", "PvcName": "ckpt"}, "s2": {"ImageUri": IMAGE}}
    r = render(outputs=outputs)
    assert r.container["image"] == IMAGE
    # every namespaced object; the hung-node marker's ClusterRole and its binding are cluster-scoped (nodes are)
    assert {o["metadata"]["namespace"] for o in r.objects()
            if o["kind"] not in ("ClusterRole", "ClusterRoleBinding")} == {"ml"}
    # The Namespace (with the PVC in it) is the infra stack's: deleting dist/ must not delete it.
    assert not [o for o in r.objects() if o["kind"] == "Namespace"]
    assert {"name": "fsx", "persistentVolumeClaim": {"claimName": "ckpt"}} in r.pod["volumes"]
    assert "infra outputs: " in r.stdout and "placeholder" not in r.stdout


def test_without_outputs_placeholders_are_used_and_announced(render):
    r = render(outputs=None)
    assert r.container["image"] == PLACEHOLDER_IMAGE
    assert "not found: placeholders" in r.stdout
    # The platform's own image, when configured, is no placeholder.
    image = "123456789012.dkr.ecr.us-east-1.amazonaws.com/train:1.0"
    assert render(outputs=None, context={"imageUri": image}).container["image"] == image


def test_training_container_has_no_capability_and_logs_the_nccl_transport_once(render):
    r = render()
    # No IPC_LOCK on EFA either: a non-root process never holds an added capability (docs/security.md).
    assert r.container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    # NCCL's INIT and NET lines (NET/OFI or NET/Socket) on a pod's first worker attempt only.
    assert (r.env["NCCL_DEBUG"], r.env["NCCL_DEBUG_FIRST_ATTEMPT"], r.env["NCCL_DEBUG_SUBSYS"]) == ("WARN", "INFO", "INIT,NET")
    g6 = render(*fitting("g6.xlarge"), context={"gpuInstanceType": "g6.xlarge", "gpuNodesMin": 1, "gpuNodesDesired": 1})
    assert g6.container["securityContext"]["capabilities"] == {"drop": ["ALL"]}


def _pod_spec_of(obj: dict) -> dict:
    """The pod spec of a workload (Job, Deployment, CronJob), {} for anything else."""
    spec = obj.get("spec", {})
    if obj["kind"] == "CronJob":
        spec = spec["jobTemplate"]["spec"]
    return spec.get("template", {}).get("spec", {})
