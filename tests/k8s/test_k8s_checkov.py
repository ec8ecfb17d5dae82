"""checkov over everything `make manifests` can write: no unsuppressed failure, and every skip is
an annotation on the object with its reason, used by checkov (no stale skips). One run (~5 s)."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CHECKOV = REPO / ".venv" / "tools" / "checkov" / "bin" / "checkov"


def _annotated_skips(rendered) -> dict[tuple[str, str], str]:
    """(resource id as checkov names it, check id) -> reason, from checkov.io/skip annotations."""
    skips = {}
    for obj in rendered.objects():
        meta = obj["metadata"]
        resource = f"{obj['kind']}.{meta.get('namespace', 'default')}.{meta['name']}"
        for key, value in meta.get("annotations", {}).items():
            if key.startswith("checkov.io/skip"):
                check, reason = value.split("=", 1)
                skips[resource, check] = reason
    return skips


def test_checkov_passes_with_reasoned_skips_only(render, tmp_path):
    if not CHECKOV.exists():
        pytest.fail(f"{CHECKOV} is missing: run `make setup` (checkov has its own virtual environment)")
    r = render("--fault-injection", "--set", "fault_tolerance.restart=both")
    report_job = render("--report")  # `--report` writes apart from the training manifests; scanned with them
    shutil.copy(report_job.outdir / "report.k8s.yaml", r.outdir)
    replicas = render("--train-config", str(REPO / "k8s" / "train-replicas.yaml"))  # the replica groups' Jobs
    shutil.copy(replicas.outdir / "training.k8s.yaml", r.outdir / "training-replicas.k8s.yaml")
    proc = subprocess.run([str(CHECKOV), "--directory", str(r.outdir), "--framework", "kubernetes",
                           "--skip-download", "--output", "json"],  # --skip-download: offline, no API calls
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    report = json.loads(proc.stdout)
    report = report[0] if isinstance(report, list) else report
    summary, results = report["summary"], report["results"]
    failed = [(c["check_id"], c["resource"], c["check_name"]) for c in results["failed_checks"]]
    assert failed == [] and proc.returncode == 0, failed
    assert summary["parsing_errors"] == 0
    checked = {c["resource"] for kind in ("passed_checks", "skipped_checks") for c in results[kind]}
    workloads = {"Job.training.fsdp-train", "Deployment.training.fsdp-train-rendezvous",
                 "CronJob.training.fsdp-train-chaos", "Job.training.fsdp-train-report", "Job.training.fsdp-train-g1",
                 "Deployment.training.fsdp-train-lighthouse", "Deployment.training.fsdp-train-g1-rendezvous"}
    assert workloads <= checked  # the workloads were scanned

    skipped = {(c["resource"], c["check_id"]): c["check_result"]["suppress_comment"] for c in results["skipped_checks"]}
    assert skipped == _annotated_skips(r) | _annotated_skips(report_job) | _annotated_skips(replicas)
    assert all(len(reason) > 20 for reason in skipped.values())
