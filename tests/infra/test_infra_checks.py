"""Static checks over the synthesized app: cdk-nag AwsSolutions, cfn-lint, and the real CDK CLI."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import aws_cdk as cdk
import pytest
from cdk_nag import AwsSolutionsChecks
from cfnlint.api import lint

from infra.platform import build_platform

MIN_REASON_WORDS = 8


@pytest.fixture(scope="module")
def nag_app(full, make_app, tmp_path_factory) -> cdk.App:
    """The full-featured config once more, this time with AwsSolutionsChecks as a validation plugin."""
    outdir = tmp_path_factory.mktemp("nag")
    app, config = make_app(outdir, full.config.to_context())
    cdk.Validations.of(app).add_plugins(AwsSolutionsChecks(app))
    build_platform(app, config)
    try:
        app.synth()
    except RuntimeError as error:  # the plugin fails synthesis on any unacknowledged finding
        report = json.loads((outdir / "validation-report.json").read_text())
        findings = [
            f"{v['ruleName']} at {[c['constructPath'] for c in v['violatingConstructs']]}"
            for plugin in report["pluginReports"] for v in plugin["violations"]
        ]
        pytest.fail(f"{error}\n" + "\n".join(findings))
    return app


def test_aws_solutions_checks_find_no_unacknowledged_error(nag_app):
    assert nag_app  # synthesis with the plugin succeeded; on a finding the fixture lists them


def test_each_acknowledgment_names_an_aws_solutions_rule_and_a_reason(nag_app):
    acknowledged = {
        (c.node.path, rule): reason
        for c in nag_app.node.find_all()
        for m in c.node.metadata if m.type == "aws:cdk:acknowledged-rules"
        for rule, reason in m.data.items() if rule.startswith("AwsSolutions::")
    }
    assert acknowledged, "expected the managed-policy and kubectl-provider acknowledgments"
    for (path, rule), reason in acknowledged.items():
        assert rule.startswith("AwsSolutions::AwsSolutions-"), (path, rule)
        assert len(reason.split()) >= MIN_REASON_WORDS, f"{path} {rule}: reason too thin: {reason!r}"


def _lint_errors(synth, stack: str) -> list[str]:
    matches = lint(json.dumps(synth.templates[stack]), regions=[synth.config.region])
    return [f"{stack}: {m.rule.id} {m.message} at {m.path}" for m in matches if m.rule.id.startswith("E")]


@pytest.mark.parametrize("stack", ["Network", "Storage", "Cluster"])
def test_cfn_lint_finds_no_error(full, defaults, stack):
    assert _lint_errors(full, stack) + _lint_errors(defaults, stack) == []


def test_cfn_lint_finds_no_error_in_other_instance_and_capacity_variants(variant):
    """The cluster stack depends on the instance type and capacity option; storage on the S3 import (g6)."""
    assert _lint_errors(variant, "Cluster") + _lint_errors(variant, "Storage") == []


def _cdk_cli(repo_root: Path, *args: str) -> subprocess.CompletedProcess:
    """The CDK CLI as a user runs it from the repository (`npx cdk ...`), without AWS credentials."""
    cli = repo_root / "node_modules" / ".bin" / "cdk"
    if not cli.exists():
        pytest.skip("node_modules/.bin/cdk is missing: `make setup` installs the CDK CLI (npm ci)")
    env = {
        **os.environ,
        "JSII_SILENCE_WARNING_DEPRECATED_NODE_VERSION": "1",
        "CDK_DISABLE_CLI_TELEMETRY": "true",
        "AWS_EC2_METADATA_DISABLED": "true",  # no credentials here: do not wait on the metadata service
    }
    for variable in ("AWS_PROFILE", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        env.pop(variable, None)
    return subprocess.run([str(cli), *args], cwd=repo_root, env=env, capture_output=True, text=True, timeout=300)


def test_cdk_cli_synthesizes_the_app_offline(repo_root, tmp_path):
    result = _cdk_cli(repo_root, "synth", "--quiet", "--no-notices", "--output", str(tmp_path / "cdk.out"))
    assert result.returncode == 0, result.stdout + result.stderr
    out = tmp_path / "cdk.out"
    for stack in ("Network", "Storage", "Cluster"):
        assert json.loads((out / f"{stack}.template.json").read_text())["Resources"]
    # cdk.json as shipped has no imageUri: the image is an asset that `cdk deploy` builds and pushes.
    [image] = json.loads((out / "Cluster.assets.json").read_text())["dockerImages"].values()
    assert image["source"]["dockerFile"] == "training/Dockerfile"


def test_cdk_cli_reports_a_bad_config_value_in_one_line(repo_root, tmp_path):
    """`cdk synth -c ...` with counts that cannot hold: the config's message and a failed exit, no traceback."""
    result = _cdk_cli(repo_root, "synth", "--quiet", "--no-notices", "--output", str(tmp_path / "cdk.out"),
                      "-c", "gpuNodesDesired=5", "-c", "gpuNodesMax=4")
    assert result.returncode != 0
    assert "Traceback" not in result.stdout + result.stderr
    assert ("error: GPU node counts must satisfy gpuNodesMin <= gpuNodesDesired <= gpuNodesMax; got gpuNodesMin=2, "
            "gpuNodesDesired=5, gpuNodesMax=4") in result.stderr.splitlines()
    assert not list((tmp_path / "cdk.out").glob("*.template.json")), "nothing may be synthesized"
