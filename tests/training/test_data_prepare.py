"""`python -m training.data prepare`: a tokenizer trained here on the corpus in tests/training/corpus,
the token file and sidecar it writes, the errors it gives, and a training run that reads the file."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from training.contract.config import DataConfig, TrainingConfig
from training.contract.exit_codes import CONFIG_ERROR
from training.contract.shapes import PRESETS
from training.data.prepare import PrepareError, prepare, sha256_of
from training.data.stream import TokenStream
from training.data.token_file import DataError, check_token_file, sidecar_path
from training.local.shape import ClusterShape
from training_helpers import REPO_ROOT, completed, events_named, run_forked, run_local

CORPUS = Path(__file__).parent / "corpus"
TEXT, JSONL = CORPUS / "notes.txt", CORPUS / "records.jsonl"


def _documents() -> list[str]:
    return [json.loads(line)["text"] for line in JSONL.read_text().splitlines() if line.strip()] + [TEXT.read_text()]


def _bpe(path: Path, vocab_size: int, byte_level: bool = False) -> Path:
    """A BPE tokenizer trained on the corpus, saved as a tokenizer.json."""
    tokenizer = Tokenizer(models.BPE())
    if byte_level:  # 256 byte symbols before any merge
        tokenizer.pre_tokenizer, tokenizer.decoder = pre_tokenizers.ByteLevel(), decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      show_progress=False)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never")
        tokenizer.decoder = decoders.Metaspace(prepend_scheme="never")
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False)
    tokenizer.train_from_iterator(_documents(), trainer)
    tokenizer.save(str(path))
    return path


@pytest.fixture
def tokenizer_json(tmp_path: Path) -> Path:
    return _bpe(tmp_path / "tokenizer.json", vocab_size=PRESETS["tiny"].vocab_size)


def test_prepare_writes_tokens_that_round_trip_and_a_sidecar(tmp_path, tokenizer_json):
    out = tmp_path / "corpus.bin"
    proc = subprocess.run([sys.executable, "-m", "training.data", "prepare", str(JSONL), str(TEXT),
                           "--tokenizer", str(tokenizer_json), "--out", str(out)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    info = json.loads(sidecar_path(out).read_text())
    tokens = np.fromfile(out, dtype=np.uint16)
    assert info["dtype"] == "uint16" and info["vocab_size"] == 256 and info["tokens"] == tokens.size > 0
    assert info["tokenizer"] == {"path": str(tokenizer_json), "sha256": sha256_of(tokenizer_json)}
    assert info["sources"] == [{"path": str(p), "sha256": sha256_of(p)} for p in (JSONL, TEXT)]
    # every JSONL record, then the text file: decoding the file gives the text back
    assert Tokenizer.from_file(str(tokenizer_json)).decode(tokens.tolist()) == "".join(_documents())
    assert f"wrote {out}" in proc.stdout and not list(tmp_path.glob(".*tmp*"))  # no temporary file left


def test_field_flag_and_eos_between_documents(tmp_path):
    records = tmp_path / "r.jsonl"
    records.write_text('{"body": "one two"}\n{"body": "three"}\n')
    tokenizer = Tokenizer(models.WordLevel({"one": 0, "two": 1, "three": 2, "<eos>": 3}, unk_token="<eos>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(tmp_path / "t.json"))
    prepare([records], tmp_path / "t.json", tmp_path / "out.bin", field="body", eos="<eos>")
    assert np.fromfile(tmp_path / "out.bin", dtype=np.uint16).tolist() == [0, 1, 3, 2, 3]


def test_a_vocabulary_past_65536_ids_is_written_as_uint32(tmp_path):
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(70000)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(tmp_path / "t.json"))
    (tmp_path / "doc.txt").write_text("w1 w65536 w69999")
    info = prepare([tmp_path / "doc.txt"], tmp_path / "t.json", tmp_path / "out.bin")
    assert info["dtype"] == "uint32"
    assert np.fromfile(tmp_path / "out.bin", dtype=np.uint32).tolist() == [1, 65536, 69999]


@pytest.mark.parametrize("case, message", [
    ("missing input", "nope.txt: no such file"),
    ("malformed line", "bad.jsonl:2: not valid JSON"),
    ("missing field", "bad.jsonl:1: expected a JSON object with a string field 'text'"),
    ("not utf-8", "binary.txt (byte 1): not UTF-8 text"),
    ("unknown tokenizer", "--tokenizer"),
    ("not a tokenizer", "not a `tokenizers` tokenizer file"),
])
def test_bad_inputs_fail_with_a_clear_error_and_write_nothing(tmp_path, tokenizer_json, case, message):
    inputs, tokenizer = [TEXT], tokenizer_json
    if case == "missing input":
        inputs = [tmp_path / "nope.txt"]
    elif case == "malformed line":
        (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"text": "cut\n')
        inputs = [tmp_path / "bad.jsonl"]
    elif case == "missing field":
        (tmp_path / "bad.jsonl").write_text('{"content": "no text field"}\n')
        inputs = [tmp_path / "bad.jsonl"]
    elif case == "not utf-8":
        (tmp_path / "binary.txt").write_bytes(b"a\xff\xfeb")
        inputs = [tmp_path / "binary.txt"]
    elif case == "unknown tokenizer":
        tokenizer = tmp_path / "missing" / "tokenizer.json"
    else:
        tokenizer = TEXT
    out = tmp_path / "out.bin"
    with pytest.raises(PrepareError) as err:
        prepare(inputs, tokenizer, out)
    assert message in str(err.value)
    assert not out.exists() and not sidecar_path(out).exists() and not list(tmp_path.glob(".out.bin*"))


def test_a_model_vocabulary_smaller_than_the_tokenizers_is_refused(tmp_path):
    tokenizer = _bpe(tmp_path / "bytes.json", vocab_size=300, byte_level=True)
    out = tmp_path / "corpus.bin"
    prepare([TEXT], tokenizer, out)
    with pytest.raises(DataError, match="vocabulary of 300 .* larger than the model's 256: choose a model whose"):
        check_token_file(str(out), None, PRESETS["tiny"].vocab_size)
    check_token_file(str(out), None, PRESETS["small"].vocab_size)  # 32000 ids: fits
    # the local cluster (and training.train) refuse it before any rank starts
    run = run_local(tmp_path / "run", *ClusterShape(nodes=1, nproc_per_node=1).argv(), "--steps", "2",
                    f"data.path={out}", timeout=60)
    assert run.returncode == CONFIG_ERROR and "larger than the model's 256" in run.output


def test_the_sidecar_fixes_the_dtype_and_catches_a_truncated_file(tmp_path, tokenizer_json):
    out = tmp_path / "corpus.bin"
    prepare([TEXT], tokenizer_json, out)
    with pytest.raises(DataError, match="data.dtype='uint32' contradicts"):
        check_token_file(str(out), "uint32", PRESETS["tiny"].vocab_size)
    out.write_bytes(out.read_bytes()[:-2])
    with pytest.raises(DataError, match="but its sidecar says"):
        TokenStream(TrainingConfig(seq_len=8, batch_size=1), DataConfig(path=str(out)), rank=0, world_size=1,
                    vocab_size=256)


def test_a_short_run_trains_on_the_prepared_file(tmp_path, tokenizer_json):
    out = tmp_path / "corpus.bin"
    prepare([JSONL, TEXT], tokenizer_json, out)
    # two ranks forked from this process: the data path is tested, not the launcher
    run = completed(run_forked(tmp_path / "run", 2, "training.steps=30", f"data.path={out}", "training.seq_len=32",
                               "checkpoint.interval=10", "logging.sample_log=true", timeout=120))
    steps = events_named(run.run_dir, "step")
    assert [e["step"] for e in steps] == list(range(1, 31))
    assert steps[-1]["loss"] < steps[0]["loss"]  # it learns the corpus
