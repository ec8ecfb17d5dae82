"""A run's final state (`checkpoint.save_final`: `<run_dir>/final`) and the bitwise comparison of two
of them: the exact-resume check of the tests and of bench/gpu.sh."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save


def load_final_state(run_dir: Path, scratch: Path) -> dict[str, Any]:
    """The run's final DCP dump as one plain dict (read without NVRx or a process group)."""
    out = scratch / f"{run_dir.name}-final.pt"
    dcp_to_torch_save(run_dir / "final", out)
    return torch.load(out, weights_only=False)


def _flatten(tree: object, prefix: str = "") -> dict[str, object]:
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _flatten(sub, f"{prefix}{key}.").items()}
    if isinstance(tree, (list, tuple)):
        return {k: v for i, sub in enumerate(tree) for k, v in _flatten(sub, f"{prefix}{i}.").items()}
    return {prefix.rstrip("."): tree}


def bitwise_mismatch(a: dict[str, Any], b: dict[str, Any]) -> str | None:
    """None when `a` and `b` hold the same entries with bitwise-equal values; else what differs."""
    fa, fb = _flatten(a), _flatten(b)
    if fa.keys() != fb.keys():
        return f"entries differ: {sorted(fa.keys() ^ fb.keys())[:5]}"
    differing = [k for k in fa if not (torch.equal(fa[k], fb[k]) if isinstance(fa[k], torch.Tensor) else fa[k] == fb[k])]
    return f"{len(differing)} of {len(fa)} entries differ, e.g. {differing[:5]}" if differing else None
