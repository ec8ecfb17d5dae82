"""`python -m training.data prepare INPUT… --tokenizer tokenizer.json|MODEL_DIR --out FILE`: text and JSONL
files to the token file that data.path reads (`token_file`). MODEL_DIR: a Hugging Face model directory (the
model.path a run trains), whose tokenizer.json is used.

Each input is a document source: a .jsonl file gives one document per line (the string in --field,
`text` by default), any other file is one UTF-8 text document. Documents are tokenized with a Hugging
Face `tokenizers` file (nothing is fetched from a hub), concatenated (with --eos between them, if given)
and written as uint16 when the vocabulary fits 65536 ids, else uint32. Beside FILE goes FILE.json: the
tokenizer's path and sha256, vocabulary size, dtype, token count, and each source with its sha256.

Both files are written under temporary names and renamed into place, so a stopped run never leaves a
half file under FILE; the loader also checks FILE's size against the sidecar's token count.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterator, Sequence

import numpy as np

from training.contract.files import replace_file
from training.contract.model_source import HF_TOKENIZER
from training.data.token_file import DataError, sidecar_path

UINT16_VOCAB = 1 << 16
BATCH_BYTES = 4 << 20  # documents are tokenized in batches of about this much text
PROGRESS_INTERVAL_S = 5.0


class PrepareError(DataError):
    """An input, the tokenizer or the output cannot be used; the message names which and why."""


@dataclass(frozen=True)
class Source:
    path: Path
    jsonl: bool


def dtype_for(vocab_size: int) -> str:
    return "uint16" if vocab_size <= UINT16_VOCAB else "uint32"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def tokenizer_file(path: Path) -> Path:
    """--tokenizer as given: a tokenizer.json, or a model directory holding one."""
    return path / HF_TOKENIZER if path.is_dir() else path


def load_tokenizer(path: Path):  # -> tokenizers.Tokenizer
    from tokenizers import Tokenizer

    if not path.is_file():
        raise PrepareError(f"--tokenizer {path}: no such file (expected a tokenizer.json saved by the "
                           "`tokenizers` library; nothing is fetched from a hub)")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as err:  # noqa: BLE001  (tokenizers raises a bare Exception for a bad file)
        raise PrepareError(f"--tokenizer {path}: not a `tokenizers` tokenizer file: {err}") from None


def documents(source: Source, field: str) -> Iterator[tuple[str, int]]:
    """(document, bytes read) of one input; a bad file or line fails naming the file (and line)."""
    try:
        with source.path.open("rb") as f:
            if not source.jsonl:
                data = f.read()
                yield _decode(data, source.path, None), len(data)
                return
            for number, line in enumerate(f, 1):
                if not line.strip():
                    yield "", len(line)
                    continue
                try:
                    record = json.loads(_decode(line, source.path, number))
                except json.JSONDecodeError as err:
                    raise PrepareError(f"{source.path}:{number}: not valid JSON ({err.msg})") from None
                if not isinstance(record, dict) or not isinstance(record.get(field), str):
                    raise PrepareError(f"{source.path}:{number}: expected a JSON object with a string field "
                                       f"{field!r} (--field names another)")
                yield record[field], len(line)
    except OSError as err:
        raise PrepareError(f"{source.path}: cannot be read: {err.strerror or err}") from None


def _decode(data: bytes, path: Path, line: int | None) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        where = f"{path}:{line}" if line is not None else f"{path} (byte {err.start})"
        raise PrepareError(f"{where}: not UTF-8 text") from None


def _sources(inputs: Sequence[Path]) -> list[Source]:
    sources = []
    for path in inputs:
        if not path.is_file():
            raise PrepareError(f"{path}: no such file (inputs are .txt/.md text files or .jsonl files)")
        if not os.access(path, os.R_OK):
            raise PrepareError(f"{path}: cannot be read (permission denied)")
        sources.append(Source(path, jsonl=path.suffix == ".jsonl"))
    return sources


class _Progress:
    """A line on stderr every few seconds: large inputs take minutes."""

    def __init__(self, total_bytes: int) -> None:
        self.total, self.done, self.tokens = total_bytes, 0, 0
        self._last = time.monotonic()

    def add(self, read: int, tokens: int, force: bool = False) -> None:
        self.done, self.tokens = self.done + read, self.tokens + tokens
        if force or time.monotonic() - self._last >= PROGRESS_INTERVAL_S:
            print(f"{self.done / 1e6:.1f} of {self.total / 1e6:.1f} MB, {self.tokens:,} tokens", file=sys.stderr,
                  flush=True)
            self._last = time.monotonic()


def prepare(inputs: Sequence[Path], tokenizer_path: Path, out: Path, field: str = "text",
            eos: str | None = None) -> dict:
    """Tokenize `inputs` into `out` and its sidecar; returns the sidecar's content."""
    tokenizer_path = tokenizer_file(tokenizer_path)
    tokenizer = load_tokenizer(tokenizer_path)
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    eos_id = None
    if eos is not None:
        eos_id = tokenizer.token_to_id(eos)
        if eos_id is None:
            raise PrepareError(f"--eos {eos!r}: not a token of {tokenizer_path}")
    sources = _sources(inputs)
    if not out.parent.is_dir():
        raise PrepareError(f"--out {out}: directory {out.parent} does not exist")
    dtype = np.dtype(dtype_for(vocab_size))
    progress = _Progress(sum(s.path.stat().st_size for s in sources))
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        with tmp.open("wb") as f:
            tokens = sum(_write_source(f, s, tokenizer, field, eos_id, dtype, progress) for s in sources)
            f.flush()
            os.fsync(f.fileno())
        if tokens == 0:
            raise PrepareError(f"{', '.join(map(str, inputs))}: no text to tokenize")
        info = {
            "format": "training.data token file v1",
            "tokenizer": {"path": str(tokenizer_path), "sha256": sha256_of(tokenizer_path)},
            "vocab_size": vocab_size,
            "dtype": dtype.name,
            "tokens": tokens,
            "eos": eos,
            "field": field,
            "sources": [{"path": str(s.path), "sha256": sha256_of(s.path)} for s in sources],
        }
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    replace_file(sidecar_path(out), (json.dumps(info, indent=2) + "\n").encode())
    progress.add(0, 0, force=True)
    return info


def _write_source(f: BinaryIO, source: Source, tokenizer, field: str, eos_id: int | None, dtype: np.dtype,
                  progress: _Progress) -> int:
    written, batch, batch_bytes, read = 0, [], 0, 0

    def flush() -> int:
        ids: list[int] = []
        for encoding in tokenizer.encode_batch(batch, add_special_tokens=False):
            ids += encoding.ids
            if eos_id is not None:
                ids.append(eos_id)
        np.asarray(ids, dtype=dtype).tofile(f)
        progress.add(read, len(ids))
        return len(ids)

    for text, size in documents(source, field):
        read += size
        if not text:
            continue
        batch.append(text)
        batch_bytes += len(text)
        if batch_bytes >= BATCH_BYTES:
            written += flush()
            batch, batch_bytes, read = [], 0, 0
    if batch or read:
        written += flush()
    return written


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.data", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("prepare", help="tokenize text / JSONL files into a token file for data.path",
                            description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="+", type=Path, metavar="INPUT", help=".jsonl (one document per line) or text")
    p.add_argument("--tokenizer", required=True, type=Path, help="a tokenizer.json of the `tokenizers` library, or a Hugging Face model "
                   "directory (model.path) holding one")
    p.add_argument("--out", required=True, type=Path, help="the token file to write (and OUT.json beside it)")
    p.add_argument("--field", default="text", help="the JSONL field holding each document (default: %(default)s)")
    p.add_argument("--eos", help="a token appended after every document, e.g. '<|endoftext|>' (default: none)")
    args = parser.parse_args(argv)
    try:
        info = prepare(args.inputs, args.tokenizer, args.out, args.field, args.eos)
    except PrepareError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}: {info['tokens']:,} {info['dtype']} tokens (vocabulary {info['vocab_size']:,}) "
          f"from {len(info['sources'])} file(s); {sidecar_path(args.out)}")
    return 0
