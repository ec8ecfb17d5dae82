"""`python -m training.export RUN_DIR --out DIR [--checkpoint PATH] [--dtype bfloat16]`: the model of a
finished run (`<run_dir>/final`, written with checkpoint.save_final) or of any committed checkpoint (the
newest by default, or the one named) as a Hugging Face model directory: config.json, safetensors in the
hub's layout (5 GB shards and their index, as transformers' save_pretrained writes them; Mixtral's experts
one tensor per expert) and the source's tokenizer files. `AutoModelForCausalLM.from_pretrained(DIR)` loads
it. A preset exports as a LlamaForCausalLM.

The run's config comes from its event log (`run_config`), so the exported model is the one that ran. Cost:
the model's tensors are read into one process, in float32 (`load_model_state`: an 8B model takes 32 GB of
memory); --dtype bfloat16 halves what is written (`write_hf`).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import warnings
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from training.contract.config import ConfigArgumentParser, TrainConfig, load_train_config
from training.contract.events import read_events
from training.contract.exit_codes import CONFIG_ERROR
from training.contract.model_source import ModelSourceError
from training.models.layout import untied_state
from training.models.spec import ModelSpec, model_spec
from training.train.checkpoint.layout import committed_checkpoints

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
MAX_SHARD_SIZE = "5GB"  # transformers' default for save_pretrained


class ExportError(ValueError):
    """Nothing to export from the run or checkpoint named; the message says why."""


def run_config(run_dir: Path) -> TrainConfig:
    """The config the run last started with (its newest run_start event), so the exported model is the one
    that ran."""
    try:
        starts = [e for e in read_events(run_dir) if e["event"] == "run_start"]
    except FileNotFoundError:
        starts = []
    if not starts:
        raise ExportError(f"{run_dir}: no run_start event in its event log: not a training run directory")
    config = starts[-1]["config"]
    return load_train_config(None, [f"{k}={json.dumps(v)}" for k, v in _flat(config).items()])


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out |= _flat(value, f"{prefix}{key}.")
        else:
            out[prefix + key] = value
    return out


def source_checkpoint(cfg: TrainConfig, checkpoint: Path | None) -> Path:
    """The checkpoint named, else the run's final state, else its newest committed checkpoint."""
    if checkpoint is not None:
        if not (checkpoint / ".metadata").is_file():
            raise ExportError(f"--checkpoint {checkpoint}: not a DCP checkpoint (no .metadata)")
        return checkpoint
    final = Path(cfg.run_dir) / "final"
    if (final / ".metadata").is_file():
        return final
    committed = committed_checkpoints(cfg.checkpoint_dir)
    if not committed:
        raise ExportError(f"{cfg.run_dir}: no final state and no committed checkpoint in {cfg.checkpoint_dir}")
    return committed[0][1]


def load_model_state(spec: ModelSpec, checkpoint: Path) -> dict[str, torch.Tensor]:
    """The model's tensors from a DCP checkpoint (the trainer's "model" entry), whole, in one process: the
    model's only (not the optimizer's), in float32, so an 8B model takes 32 GB of memory."""
    model = spec.build("meta")
    state = {name: torch.empty(t.shape, dtype=t.dtype) for name, t in untied_state(model, model.state_dict()).items()}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({"model": state}, checkpoint_id=checkpoint, no_dist=True)
    return state


def write_hf(spec: ModelSpec, state: dict[str, torch.Tensor], out: Path, dtype: torch.dtype) -> None:
    """config.json, the safetensors shards (with their index when there are several) and the tokenizer
    files, written into a temporary directory that is renamed to `out`: a stopped export leaves no half model.
    A `dtype` other than float32 (--dtype bfloat16) is converted one tensor at a time (a tensor more at its
    peak: for Mixtral a layer's fused experts) and halves what is written."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    hf_state = dict(spec.to_hf(state))  # a dict of its own: to_hf may return `state` itself
    state.clear()  # only hf_state holds the tensors from here
    for name in list(hf_state):  # one tensor at a time, each float32 original dropped as its copy is made
        hf_state[name] = hf_state[name].to(dtype).contiguous()
    partial = out.with_name(f".{out.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    config = spec.hf_config()
    config.dtype = dtype
    config.save_pretrained(partial)
    split = split_torch_state_dict_into_shards(hf_state, max_shard_size=MAX_SHARD_SIZE)
    for filename, names in split.filename_to_tensors.items():
        save_file({name: hf_state[name] for name in names}, partial / filename, metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        (partial / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    for file in spec.source_files:
        shutil.copy2(file, partial / file.name)
    partial.rename(out)


def export(run_dir: Path, out: Path, checkpoint: Path | None = None, dtype: str = "float32",
           model_dir: Path | None = None) -> Path:
    """Export the run at `run_dir` into `out`; returns the checkpoint exported. The final state and checkpoints
    are looked up under `run_dir` as given (a run directory copied elsewhere exports as well), checkpoints in a
    checkpoint.dir of their own where the config put them, and a Hugging Face model's directory (config.json,
    tokenizer files) at model.path unless `model_dir` (--model-dir) names where it is now."""
    if out.exists():
        raise ExportError(f"--out {out} exists: name a new directory")
    cfg = run_config(run_dir)
    cfg = replace(cfg, run_dir=str(run_dir))  # where the run is now, not where it ran (docstring)
    if model_dir is not None:
        if cfg.model.source != "huggingface":
            raise ExportError(f"--model-dir {model_dir}: the run trained model.source={cfg.model.source}, "
                              "which has no model directory; --model-dir goes with model.source=huggingface")
        cfg = replace(cfg, model=replace(cfg.model, path=str(model_dir)))
    spec = model_spec(cfg.model)
    source = source_checkpoint(cfg, checkpoint)
    write_hf(spec, load_model_state(spec, source), out, DTYPES[dtype])
    return source


def main(argv: list[str] | None = None) -> int:
    p = ConfigArgumentParser(prog="python -m training.export", description=__doc__.split("\n\n")[0],
                             formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", type=Path, help="the run's directory (its event log names its config)")
    p.add_argument("--out", type=Path, required=True, help="the Hugging Face model directory to write (new)")
    p.add_argument("--checkpoint", type=Path, default=None,
                   help="a committed checkpoint directory (default: <run_dir>/final, else the newest committed)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="the exported weights' dtype")
    p.add_argument("--model-dir", type=Path, default=None,
                   help="model.source=huggingface: the model's directory, where it is now (default: the run's model.path)")
    args = p.parse_args(argv)
    try:
        source = export(args.run_dir, args.out, args.checkpoint, args.dtype, args.model_dir)
    except (ExportError, ModelSourceError, OSError) as err:
        print(f"training.export: {err}", file=sys.stderr)
        return CONFIG_ERROR
    print(f"training.export: {source} -> {args.out} (AutoModelForCausalLM.from_pretrained({str(args.out)!r}))")
    return 0
