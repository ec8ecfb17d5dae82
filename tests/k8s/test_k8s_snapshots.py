"""Chart snapshots: any change to a rendered manifest shows up as a diff to review
(`pytest tests/k8s --snapshot-update` accepts it)."""
from __future__ import annotations

import pytest
from k8s_render import fitting

from training.contract.config import RESTART_MODES


def test_default_manifests(render, snapshot):
    r = render("--fault-injection")
    assert {name: (r.outdir / name).read_text() for name in r.files} == snapshot


@pytest.mark.parametrize("mode", [m for m in RESTART_MODES if m != "injob"])
def test_job_in_restart_mode(render, snapshot, mode):
    r = render("--set", f"fault_tolerance.restart={mode}")
    assert (r.outdir / "training.k8s.yaml").read_text() == snapshot


def test_job_on_a_single_gpu_instance_without_efa(render, snapshot):
    r = render(*fitting("g6.xlarge"), context={"gpuInstanceType": "g6.xlarge", "gpuNodesMin": 1, "gpuNodesDesired": 1})
    assert (r.outdir / "training.k8s.yaml").read_text() == snapshot


def test_preflight_manifest(render, snapshot):
    r = render("--preflight")
    assert (r.outdir / "nccl-preflight.k8s.yaml").read_text() == snapshot
