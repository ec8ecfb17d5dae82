"""The token file, torch-free: a flat array of token ids (uint16 or uint32) written by `python -m
training.data prepare` (`prepare`), and its JSON sidecar, FILE.json, that names its token width and
vocabulary. The checks here run before any rank starts (training.local, the pod) and again in the loader
(`stream`): the width comes from the sidecar, and a model whose vocabulary is smaller than the
tokenizer's is refused.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np


class DataError(ValueError):
    """A token file cannot serve this run; the message names the file and what is wrong."""


def sidecar_path(token_file: str | Path) -> Path:
    return Path(f"{token_file}.json")


def read_sidecar(token_file: str | Path) -> dict[str, Any] | None:
    """The token file's sidecar written by `prepare`, or None for a file without one."""
    path = sidecar_path(token_file)
    if not path.exists():
        return None
    try:
        info = json.loads(path.read_text())
        info["dtype"], info["vocab_size"], info["tokens"]  # noqa: B018  (the fields the loader relies on)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise DataError(f"{path}: not a token file sidecar written by `python -m training.data prepare` ({err})")
    return info


def token_dtype(token_file: str | Path, configured: str | None, vocab_size: int) -> str:
    """The file's token width: the sidecar's (a configured one must agree), else `configured` or uint16.
    A tokenizer vocabulary larger than the model's (`vocab_size`) is refused: its ids would not fit."""
    info = read_sidecar(token_file)
    if info is None:
        return configured or "uint16"
    if configured is not None and configured != info["dtype"]:
        raise DataError(f"data.dtype={configured!r} contradicts {sidecar_path(token_file)}, which says "
                        f"{info['dtype']!r}: leave data.dtype unset to take the file's")
    if info["vocab_size"] > vocab_size:
        raise DataError(f"{token_file} was tokenized with a vocabulary of {info['vocab_size']} "
                        f"({info.get('tokenizer', {}).get('path', 'its tokenizer')}), larger than the model's "
                        f"{vocab_size}: choose a model whose vocabulary holds at least {info['vocab_size']}")
    expected = info["tokens"] * np.dtype(info["dtype"]).itemsize
    if Path(token_file).stat().st_size != expected:
        raise DataError(f"{token_file}: {Path(token_file).stat().st_size} bytes, but its sidecar says "
                        f"{info['tokens']} {info['dtype']} tokens ({expected} bytes): prepare it again")
    return info["dtype"]


def check_token_file(path: str | None, dtype: str | None, vocab_size: int) -> None:
    """What `token_dtype` refuses, before any rank starts (training.train, training.local), for a model
    of `vocab_size` ids (its shape: training.contract.model_source)."""
    if path is not None:
        if not Path(path).is_file():
            raise DataError(f"data.path={path!r}: no such file (a .bin from `python -m training.data prepare`)")
        token_dtype(path, dtype, vocab_size)
