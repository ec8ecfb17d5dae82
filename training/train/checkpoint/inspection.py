"""What a committed checkpoint holds, or the evidence that it is damaged. Only such evidence sets a
checkpoint aside (layout.set_aside); an error that proves nothing (an I/O error, a class this image
cannot import) leaves it in place."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch.distributed.checkpoint as dcp

from training.train.checkpoint.layout import COMMIT_MARKER


@dataclass(frozen=True)
class Held:
    keys: frozenset[str]  # top-level keys of the saved state
    world_size: int | None


@dataclass(frozen=True)
class Damaged:
    evidence: str


def inspect_checkpoint(path: Path) -> Held | Damaged | str:
    """What a committed checkpoint holds, or the evidence that it is damaged: a `.metadata` or
    COMMITTED marker that does not parse, a shard file that is missing or shorter than its metadata
    says. A string when it cannot be checked: an I/O error, or a `.metadata` that names a module or class
    this image lacks (pickle's ImportError/AttributeError: written under another torch or code version,
    e.g. before an image upgrade), is no evidence of damage."""
    try:
        marker = json.loads((path / COMMIT_MARKER).read_text())
        metadata = dcp.FileSystemReader(path).read_metadata()
    except FileNotFoundError as err:
        return Damaged(f"{err.filename or err} is missing")
    except OSError as err:
        return f"{type(err).__name__}: {err}"[:300]
    except (ImportError, AttributeError) as err:  # pickle's class lookup: the bytes are fine, the code differs
        return (f"its .metadata needs code this image lacks ({f'{type(err).__name__}: {err}'[:200]}); was it "
                "written by another torch or training image version? Run that version, or convert it")
    except Exception as err:  # noqa: BLE001 (JSON or pickle that does not parse: any error the bytes cause)
        return Damaged(f"unreadable marker or .metadata: {type(err).__name__}: {err}"[:300])
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        try:
            actual = (path / name).stat().st_size
        except FileNotFoundError:
            return Damaged(f"shard file {name} is missing")
        except OSError as err:
            return f"{type(err).__name__}: {err}"[:300]
        if actual < size:
            return Damaged(f"shard file {name} is truncated: {actual} bytes, its metadata needs {size}")
    keys = frozenset(fqn.split(".", 1)[0] for fqn in metadata.state_dict_metadata)
    return Held(keys, marker.get("world_size") if isinstance(marker, dict) else None)
