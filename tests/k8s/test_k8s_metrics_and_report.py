"""The training pods' metrics endpoint (scrape annotations, port, NetworkPolicy, MFU's GPU peak) and the
report Job that `python k8s/main.py --report` renders."""
from __future__ import annotations

import pytest
import yaml

from infra.config import CHECKPOINT_MOUNT_PATH, PVC_NAME, SYSTEM_NODE_LABEL
from infra.instances import INSTANCE_TYPES
from k8s.charts.objects import CONTAINER_SECURITY_CONTEXT, TRAINING_POD_SECURITY_CONTEXT
from k8s.charts.report import REPORT_HOLD_S
from k8s_render import IMAGE, fitting


def _train_config(r) -> dict:
    (text,) = r.config_map("fsdp-train-config").values()
    return yaml.safe_load(text)


def test_training_pods_carry_the_scrape_annotations_and_admit_the_scrape(render):
    r = render()
    port = _train_config(r)["metrics"]["port"]
    assert port == 9464  # k8s/train.yaml
    template = r.one("Job")["spec"]["template"]
    assert template["metadata"]["annotations"] == {
        "prometheus.io/scrape": "true", "prometheus.io/port": "9464", "prometheus.io/path": "/metrics"}
    policy = next(o for o in r.objects() if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == "fsdp-train")
    ingress = policy["spec"]["ingress"]
    # the job's own pods on every port; the Prometheus server of the monitoring namespace on the metrics port only
    assert {"from": [{"podSelector": policy["spec"]["podSelector"]}]} in ingress
    assert {"from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
                      "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}],
            "ports": [{"protocol": "TCP", "port": 9464}]} in ingress


def test_metrics_off_leaves_no_annotation_or_opening(render):
    r = render("--set", "metrics.port=0")
    assert "annotations" not in r.one("Job")["spec"]["template"]["metadata"]
    policy = next(o for o in r.objects() if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == "fsdp-train")
    assert all("ports" not in rule for rule in policy["spec"]["ingress"])


@pytest.mark.parametrize("instance_type", sorted(INSTANCE_TYPES))
def test_mfu_peak_comes_from_the_instance_table(render, instance_type):
    context = {"gpuInstanceType": instance_type, "gpuNodesMin": 1, "gpuNodesDesired": 1}
    r = render(*fitting(instance_type), context=context)
    assert _train_config(r)["metrics"]["gpu_peak_tflops"] == INSTANCE_TYPES[instance_type].gpu_peak_bf16_tflops


def test_a_peak_in_the_training_config_wins(render):
    assert _train_config(render("--set", "metrics.gpu_peak_tflops=500"))["metrics"]["gpu_peak_tflops"] == 500


def test_report_job_reads_the_run_on_fsx_and_stays_for_kubectl_cp(render):
    r = render("--report", "--set", "run_dir=/fsx/runs/exp-7")
    assert list(r.files) == ["report.k8s.yaml"]  # apart from the training manifests
    job = r.one("Job")
    assert job["metadata"]["name"] == "fsdp-train-report"
    spec = job["spec"]
    assert spec["backoffLimit"] == 0
    assert spec["ttlSecondsAfterFinished"] > 0 and spec["activeDeadlineSeconds"] > REPORT_HOLD_S
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    assert pod["nodeSelector"] == {SYSTEM_NODE_LABEL: "true"}  # no GPU node for a report
    assert pod["securityContext"] == dict(TRAINING_POD_SECURITY_CONTEXT)  # the training user, never root
    (container,) = pod["containers"]
    assert container["image"] == IMAGE
    assert container["securityContext"] == CONTAINER_SECURITY_CONTEXT and CONTAINER_SECURITY_CONTEXT["readOnlyRootFilesystem"]
    assert container["resources"]["limits"]["memory"] and container["resources"]["requests"]["cpu"]
    shell = container["command"][-1]
    assert shell.startswith("python -m training.report --plot /fsx/runs/exp-7 && ")
    assert shell.endswith(f"sleep {REPORT_HOLD_S}")  # bounded: kubectl cp can reach timeline.png, then it ends
    volumes = {v["name"]: v for v in pod["volumes"]}
    # the run's directory alone
    fsx = next(m for m in container["volumeMounts"] if m["mountPath"] == f"{CHECKPOINT_MOUNT_PATH}/runs/exp-7")
    assert fsx["subPath"] == "runs/exp-7"
    assert volumes[fsx["name"]]["persistentVolumeClaim"] == {"claimName": PVC_NAME}
    assert not fsx.get("readOnly")  # it writes report.json and timeline.png beside the event log
    assert "kubectl cp" in r.stdout and "/fsx/runs/exp-7/timeline.png" in r.stdout


def test_report_keeps_the_training_manifests(render, tmp_path):
    r = render()
    training = sorted(p.name for p in r.outdir.glob("*.k8s.yaml"))
    render("--report", "--outdir", str(r.outdir))
    assert sorted(p.name for p in r.outdir.glob("*.k8s.yaml")) == sorted([*training, "report.k8s.yaml"])
