"""The README is the user's first contact: its config table must match what the app really reads."""
from __future__ import annotations

import json
import re
from pathlib import Path

from infra.config import PlatformConfig

ROOT = Path(__file__).resolve().parents[1]


def _readme_config_table() -> dict[str, str]:
    rows = re.findall(r"^\| `(\w+)` \| `([^`]*)` \|", (ROOT / "README.md").read_text(), flags=re.M)
    return dict(rows)


def test_readme_lists_every_platform_config_key_with_its_cdk_json_default():
    table = _readme_config_table()
    context = json.loads((ROOT / "cdk.json").read_text())["context"]
    defaults = PlatformConfig().to_context()
    assert set(table) == set(defaults), "README config table and PlatformConfig keys differ"
    for key, value in defaults.items():
        assert context[key] == value, f"cdk.json default of {key} differs from PlatformConfig"
        # Strings stand bare in the table, everything else as JSON.
        expected = value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))
        assert table[key] == expected, f"README default of {key} is {table[key]}, the app uses {expected}"


def test_readme_starts_with_the_two_commands_and_they_are_make_targets():
    readme = (ROOT / "README.md").read_text()
    first_block = readme.split("```bash", 1)[1].split("```", 1)[0]
    assert [line.split("#")[0].strip() for line in first_block.strip().splitlines()] == ["make demo", "make test"]
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), flags=re.M))
    assert {"demo", "test", "synth", "manifests", "bench"} <= targets
