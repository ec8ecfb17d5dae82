"""The rooms of training/ and who may import whom (README.md, Layout): imports flow one way, no module
imports another in a circle, and rendering manifests never loads torch."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
# room -> the rooms it may import (itself included). The contract sits at the bottom; the runtime (train)
# above the models, data and report it uses; the pod's processes and the local cluster above the contract.
ALLOWED = {
    "contract": {"contract"},
    "models": {"contract", "models"},
    "data": {"contract", "data"},
    "report": {"contract", "report"},
    "plan": {"contract", "plan"},
    "train": {"contract", "models", "data", "report", "train"},
    "pod": {"contract", "pod"},
    "local": {"contract", "data", "pod", "report", "local"},
    "export": {"contract", "models", "train", "export"},
}


def _imports(path: Path) -> set[str]:
    """Every training.* module a file imports, wherever the import statement is."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "training":
            found |= {node.module} if node.module.count(".") > 1 or node.module == "training" else {node.module}
            found |= {f"{node.module}.{a.name}" for a in node.names
                      if (REPO_ROOT / node.module.replace(".", "/") / f"{a.name}.py").exists()}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "training"}
    return found


def _module(path: Path) -> str:
    return ".".join(path.relative_to(REPO_ROOT).with_suffix("").parts).removesuffix(".__init__")


def _training_modules() -> dict[str, set[str]]:
    return {_module(p): _imports(p) for p in sorted((REPO_ROOT / "training").rglob("*.py"))}


def test_every_module_lives_in_a_room():
    loose = [m for m in _training_modules() if m != "training" and m.split(".")[1] not in ALLOWED]
    assert not loose, f"modules outside the rooms {sorted(ALLOWED)}: {loose} (README.md, Layout)"


def test_rooms_import_only_the_rooms_below_them():
    wrong = [f"{module} imports {target}" for module, targets in _training_modules().items() if module != "training"
             for target in targets
             if target.split(".")[1:2] and target.split(".")[1] not in ALLOWED[module.split(".")[1]]]
    assert not wrong, wrong


def test_no_import_circles():
    modules = _training_modules()  # parsed once: every file's imports
    graph = {m: {t for t in targets if t in modules} - {m} for m, targets in modules.items()}
    # package __init__ modules import nothing, so a cycle is between modules proper
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(trail[trail.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, [*trail, nxt])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, cycles


def test_k8s_imports_only_the_contract():
    wrong = [f"{p.relative_to(REPO_ROOT)} imports {t}" for p in sorted((REPO_ROOT / "k8s").rglob("*.py"))
             for t in _imports(p) if not t.startswith("training.contract")]
    assert not wrong, wrong


def test_rendering_manifests_loads_no_torch():
    probe = "import sys, k8s.main; print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy')))"
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", f"importing k8s.main loaded {out.stdout.strip()}"


def test_the_contract_loads_no_torch():
    modules = [_module(p) for p in sorted((REPO_ROOT / "training" / "contract").glob("*.py"))]
    probe = f"import sys; import {', '.join(modules)}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
