"""The README and docs/ are the user's first contact: their tables must match what the app really reads, and
every link in them must lead somewhere."""
from __future__ import annotations

import json
import re
from pathlib import Path

from infra.config import PlatformConfig
from training.contract.events import EVENTS
from training.contract.faults import KINDS

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def _config_table() -> dict[str, str]:
    rows = re.findall(r"^\| `(\w+)` \| `([^`]*)` \|", (DOCS / "deploying.md").read_text(), flags=re.M)
    return dict(rows)


def test_docs_list_every_platform_config_key_with_its_cdk_json_default():
    table = _config_table()
    context = json.loads((ROOT / "cdk.json").read_text())["context"]
    defaults = PlatformConfig().to_context()
    assert set(table) == set(defaults), "docs/deploying.md config table and PlatformConfig keys differ"
    for key, value in defaults.items():
        assert context[key] == value, f"cdk.json default of {key} differs from PlatformConfig"
        # Strings stand bare in the table, everything else as JSON.
        expected = value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))
        assert table[key] == expected, f"docs/deploying.md default of {key} is {table[key]}, the app uses {expected}"


def test_readme_starts_with_the_two_commands_and_they_are_make_targets():
    readme = (ROOT / "README.md").read_text()
    first_block = readme.split("```bash", 1)[1].split("```", 1)[0]
    assert [line.split("#")[0].strip() for line in first_block.strip().splitlines()] == ["make demo", "make test"]
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), flags=re.M))
    assert {"demo", "test", "synth", "manifests", "bench"} <= targets


def test_readme_is_a_front_page():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but hyphens dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)
    return {_slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, flags=re.M)}


def _links(page: Path) -> list[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)  # not inside code blocks
    return re.findall(r"\]\(([^)\s]+)\)", text)


def test_every_relative_link_in_the_readme_and_docs_resolves():
    broken = []
    for page in PAGES:
        for link in _links(page):
            if re.match(r"^[a-z]+:", link):  # https:, mailto:
                continue
            path, _, anchor = link.partition("#")
            target = (page.parent / path).resolve() if path else page
            if not target.exists():
                broken.append(f"{page.relative_to(ROOT)}: {link} (no such file)")
            elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
                broken.append(f"{page.relative_to(ROOT)}: {link} (no such heading)")
    assert not broken, broken


def test_no_page_points_outside_the_repository():
    for page in [*PAGES, *ROOT.glob("training/**/*.py"), *ROOT.glob("k8s/**/*.py"), *ROOT.glob("infra/**/*.py")]:
        assert "../shared" not in page.read_text(), f"{page.relative_to(ROOT)} links outside the repository"


def test_the_fault_grammar_page_has_a_row_for_every_kind():
    rows = set(re.findall(r"^\| `([a-z-]+)@", (DOCS / "faults.md").read_text(), flags=re.M))
    assert rows == set(KINDS), f"docs/faults.md rows {sorted(rows)} differ from KINDS {sorted(KINDS)}"


def test_the_event_schema_page_has_a_row_for_every_event():
    rows = set(re.findall(r"^\| `(\w+)` \|", (DOCS / "observability.md").read_text(), flags=re.M))
    schema = {row for row in rows if not row.startswith("training_")}  # the metrics table's rows apart
    assert schema == set(EVENTS), f"docs/observability.md rows {sorted(schema)} differ from EVENTS {sorted(EVENTS)}"
