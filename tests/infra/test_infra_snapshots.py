"""One snapshot per stack of the full-featured config. Update with `pytest tests/infra --snapshot-update`
after a reviewed change; the assertions in the other modules say what must hold, this says what changed."""
from __future__ import annotations

import json
import re

import pytest
from syrupy.extensions.json import JSONSnapshotExtension

_ASSET_HASH = re.compile(r"\b[0-9a-f]{64}\b")


def _mask_asset_hashes(template: dict) -> dict:
    """Asset hashes move with aws-cdk-lib and layer builds, not with this project's resources."""
    return json.loads(_ASSET_HASH.sub("<asset-hash>", json.dumps(template)))


@pytest.mark.parametrize("stack", ["Network", "Storage", "Cluster"])
def test_stack_template_snapshot(full, stack, snapshot):
    assert _mask_asset_hashes(full.templates[stack]) == snapshot.use_extension(JSONSnapshotExtension)
