"""Models as specs (training/models/): a Hugging Face causal LM from a local directory is built, sharded,
loaded and exported as a preset is, and every room takes its numbers from it. Tiny configs of four
families, written here (no hub), Mixtral's experts in the hub's layout (one tensor per expert) and fused.
A bad model directory is refused before any rank starts, nothing written."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, models
from transformers import AutoModelForCausalLM

from training.contract.config import ModelConfig, TrainConfigError, load_train_config
from training.contract.events import EventLog
from training.contract.exit_codes import CONFIG_ERROR
from training.contract.flops import flops_per_token
from training.contract.model_source import ModelSourceError, hf_shape, model_shape
from training.data.prepare import prepare
from training.export.export import ExportError, export
from training.models.hub_layout import hub_pieces, read_pieces
from training.models.spec import model_spec
from training.models.tiny import FAMILIES, write_tiny_model
from training.train.distributed import DistInfo, init_distributed, teardown
from training.train.trainer import build
from training.local.shape import ClusterShape
from training_helpers import rank_results, run_local

TOKENS = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))


def hf(path: Path) -> ModelConfig:
    return ModelConfig(source="huggingface", path=str(path))


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """Each family's tiny model with weights (Mixtral's experts one by one, as on the hub); llama with tied
    embeddings, and Mixtral's experts fused as transformers builds them (save_original_format=False) besides."""
    root = tmp_path_factory.mktemp("models")
    out = {family: write_tiny_model(root / family, family) for family in FAMILIES}
    out["llama-tied"] = write_tiny_model(root / "llama-tied", "llama", tie_word_embeddings=True)
    out["mixtral-fused"] = root / "mixtral-fused"
    mixtral = AutoModelForCausalLM.from_pretrained(out["mixtral"])
    mixtral.save_pretrained(out["mixtral-fused"], save_original_format=False)
    return out


def _tensor_names(directory: Path) -> set[str]:
    return set(load_file(directory / "model.safetensors"))


def test_mixtral_files_hold_the_experts_in_both_layouts(tiny_models):
    """What the tests below load: the hub's per-expert tensors, and transformers' fused ones."""
    hub, fused = _tensor_names(tiny_models["mixtral"]), _tensor_names(tiny_models["mixtral-fused"])
    assert {"model.layers.1.block_sparse_moe.experts.3.w1.weight", "model.layers.1.block_sparse_moe.gate.weight"} <= hub
    assert {"model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.gate.weight"} <= fused


@pytest.mark.parametrize("name", [*FAMILIES, "llama-tied"])
def test_config_json_gives_the_shape_transformers_builds(tiny_models, name):
    spec = model_spec(hf(tiny_models[name]))
    config = json.loads((tiny_models[name] / "config.json").read_text())
    built = spec.build("meta")
    assert hf_shape(config, name).parameters == spec.shape.parameters == sum(p.numel() for p in built.parameters())
    assert model_shape(hf(tiny_models[name])).parameters == spec.shape.parameters  # the chart's torch-free count
    assert spec.shape.vocab_size == 256 and spec.shape.parameter_bytes == 4 * spec.shape.parameters
    # FLOPs per token from the config, as the preset's from its table: 6 N + 12 L H Q T, N without the
    # embedding lookup (a tied table is also the output projection's matmul, which counts)
    dense = spec.shape.parameters - (0 if name == "llama-tied" else 256 * 64)
    if name == "mixtral":  # of each layer's 4 experts a token goes through 2: half the experts' matmuls
        dense -= sum(p.numel() for n, p in built.named_parameters() if ".experts." in n) // 2
    assert flops_per_token(spec.shape, 32) == 6 * dense + 12 * 2 * 4 * 16 * 32
    assert spec.shape.active_parameters == model_shape(hf(tiny_models[name])).active_parameters


def test_a_mixture_of_experts_other_than_mixtrals_is_refused_not_miscounted(tmp_path):
    qwen2_moe = {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "hidden_size": 2048,
                 "intermediate_size": 5632, "num_hidden_layers": 24, "num_attention_heads": 16, "vocab_size": 151936,
                 "num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408}
    (tmp_path / "config.json").write_text(json.dumps(qwen2_moe))
    with pytest.raises(ModelSourceError, match=r"model_type 'qwen2_moe' is a mixture of experts \(num_experts=60\) "
                                               r"whose parameters are not counted here"):
        model_shape(hf(tmp_path))


@pytest.mark.parametrize("name", FAMILIES)
def test_each_decoder_layer_is_sharded_on_its_own(tiny_models, name):
    spec = model_spec(hf(tiny_models[name]))
    model = spec.build("meta")
    units = [getattr(parent, child) for parent, child in spec.shard_units(model)]
    assert len(units) == 2 and {type(u).__name__ for u in units} == set(model._no_split_modules)


def test_the_fingerprint_follows_the_parameter_layout(tmp_path, tiny_models):
    same = write_tiny_model(tmp_path / "again", "llama", weights=False)
    wider = write_tiny_model(tmp_path / "wider", "llama", weights=False, intermediate_size=192)
    fingerprints = [model_spec(hf(p)).fingerprint for p in (tiny_models["llama"], same, wider, tiny_models["qwen2"])]
    assert fingerprints[0] == fingerprints[1]
    assert len({fingerprints[0], fingerprints[2], fingerprints[3], model_spec(ModelConfig()).fingerprint}) == 4


@pytest.fixture
def one_rank():
    info = init_distributed("cpu", 30)
    yield info
    teardown()


@pytest.mark.parametrize("name", ["llama-tied", "qwen2", "mixtral", "mixtral-fused"])
def test_pretrained_weights_load_into_the_sharded_model(tiny_models, one_rank, name):
    cfg = load_train_config(None, ["model.source=huggingface", f"model.path={tiny_models[name]}"])
    spec = model_spec(cfg.model)
    model, _ = build(cfg, spec, one_rank)  # seeded weights, sharded
    assert spec.load_pretrained(model)
    expected = AutoModelForCausalLM.from_pretrained(tiny_models[name])(TOKENS).logits
    torch.testing.assert_close(model(TOKENS), expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("name, offsets, shape", [
    ("gate_up_proj", (1, 100, 5), (2, 60, 35)),  # experts 1-2, rows across w1's end and w3's start
    ("gate_up_proj", (3, 0, 0), (1, 256, 64)),  # FSDP2's: whole experts
    ("gate_up_proj", (4, 0, 0), (0, 256, 64)),  # a rank past the last expert holds none
    ("down_proj", (0, 10, 100), (4, 20, 28)),
])
def test_a_shard_of_mixtrals_experts_is_read_from_the_slices_within_it(tiny_models, name, offsets, shape):
    """Any block of a fused expert parameter (a rank's shard: FSDP2 splits the experts, other placements rows
    and columns too) assembled from the hub's per-expert tensors, reading only what lies inside it."""
    name = f"model.layers.1.mlp.experts.{name}"
    fused = load_file(tiny_models["mixtral-fused"] / "model.safetensors")[name]
    pieces = hub_pieces("mixtral", name, fused.shape)
    shard = torch.full(shape, float("nan"))
    read_pieces(pieces, {p.name: tiny_models["mixtral"] / "model.safetensors" for p in pieces}, shard, offsets)
    assert torch.equal(shard, fused[tuple(slice(o, o + n) for o, n in zip(offsets, shape))])


def _load_on_rank(model_dir: str) -> tuple[int, int, dict[str, torch.Tensor]]:
    info = init_distributed("cpu", 60)
    cfg = load_train_config(None, ["model.source=huggingface", f"model.path={model_dir}"])
    spec = model_spec(cfg.model)
    model, _ = build(cfg, spec, info)
    assert spec.load_pretrained(model)
    experts = model.model.layers[0].mlp.experts.gate_up_proj
    loaded = (experts.__create_chunk_list__()[0].offsets[0], experts.to_local().shape[0],
              {name: t.full_tensor() for name, t in model.state_dict().items()})
    teardown()
    return loaded


@pytest.mark.slow
def test_mixtrals_experts_load_into_two_ranks_shards(tiny_models, tmp_path):
    """Two gloo ranks, each holding two of the four experts of every layer, load the hub's per-expert files:
    the sharded model then holds what transformers' from_pretrained builds, every parameter."""
    results = rank_results(lambda _: _load_on_rank(str(tiny_models["mixtral"])), tmp_path / "ranks")
    assert [results[rank][:2] for rank in (0, 1)] == [(0, 2), (2, 2)]  # each rank its own experts
    loaded, expected = results[0][2], AutoModelForCausalLM.from_pretrained(tiny_models["mixtral"]).state_dict()
    assert loaded.keys() == expected.keys() and all(torch.equal(t, expected[name]) for name, t in loaded.items())


def _finished_run(run_dir: Path, model_cfg: ModelConfig, loaded_on: DistInfo | None = None) -> torch.nn.Module:
    """A run directory as a finished run leaves it: run_start in its event log, the final state. The model
    seeded whole, or `loaded_on` a process group: sharded, loaded from its pretrained weights, 0 steps."""
    cfg = load_train_config(None, [f"run_dir={run_dir}", f"model.source={model_cfg.source}",
                                   f"model.preset={model_cfg.preset}", f"model.path={model_cfg.path or 'null'}"])
    spec = model_spec(cfg.model)
    if loaded_on is None:
        model = spec.build("cpu")
        spec.init_weights(model, 7)
    else:
        model, _ = build(cfg, spec, loaded_on)
        assert spec.load_pretrained(model)
    EventLog(run_dir, "rank0").emit("run_start", world_size=1, nodes=1, config=cfg.to_dict())
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=run_dir / "final", no_dist=True)
    return model


@pytest.mark.parametrize("source", ["preset", "qwen2", "llama-tied", "mixtral"])
def test_export_round_trips_through_from_pretrained(tmp_path, tiny_models, source):
    model_cfg = ModelConfig() if source == "preset" else hf(tiny_models[source])
    model = _finished_run(tmp_path / "run", model_cfg)
    export(tmp_path / "run", tmp_path / "out")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    # the preset's rotary rows differ from transformers' Llama: its wq/wk rows are permuted on export
    torch.testing.assert_close(loaded(TOKENS).logits, model(TOKENS), rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", ["mixtral", "mixtral-fused"])
def test_mixtral_loaded_and_exported_comes_back_in_the_hubs_layout(tmp_path, tiny_models, one_rank, name):
    """Mixtral's pretrained experts, one by one as on the hub or fused, loaded into the sharded model and
    exported after 0 steps: the export holds the hub's tensors, and from_pretrained computes with it exactly
    what it computes with the pretrained directory."""
    _finished_run(tmp_path / "run", hf(tiny_models[name]), loaded_on=one_rank)
    export(tmp_path / "run", tmp_path / "out")
    assert _tensor_names(tmp_path / "out") == _tensor_names(tiny_models["mixtral"])
    expected = AutoModelForCausalLM.from_pretrained(tiny_models[name])(TOKENS).logits
    torch.testing.assert_close(AutoModelForCausalLM.from_pretrained(tmp_path / "out")(TOKENS).logits, expected,
                               rtol=0, atol=0)


def test_a_run_directory_moved_elsewhere_exports_with_its_model_directory(tmp_path, tiny_models):
    model_dir = tmp_path / "models" / "llama"
    shutil.copytree(tiny_models["llama"], model_dir)
    model = _finished_run(tmp_path / "run", hf(model_dir))
    (tmp_path / "run").rename(tmp_path / "copied-run")  # e.g. copied off FSx
    shutil.rmtree(model_dir)  # the model's directory moved too
    moved = shutil.copytree(tiny_models["llama"], tmp_path / "elsewhere")
    with pytest.raises(ModelSourceError, match=re.escape(str(model_dir))):
        export(tmp_path / "copied-run", tmp_path / "out")
    export(tmp_path / "copied-run", tmp_path / "out", dtype="bfloat16", model_dir=moved)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    torch.testing.assert_close(loaded(TOKENS).logits, model(TOKENS), rtol=0.05, atol=0.05)
    _finished_run(tmp_path / "preset-run", ModelConfig())
    with pytest.raises(ExportError, match="--model-dir goes with model.source=huggingface"):
        export(tmp_path / "preset-run", tmp_path / "out2", model_dir=moved)


def test_model_path_goes_with_the_huggingface_source():
    with pytest.raises(TrainConfigError, match=r"model.path=None is not allowed: the Hugging Face model's directory"):
        load_train_config(None, ["model.source=huggingface"])
    with pytest.raises(TrainConfigError, match=r"model.path='/fsx/m' is not allowed: null with model.source=preset"):
        load_train_config(None, ["model.path=/fsx/m"])


def _vocabulary(path: Path, ids: int) -> Path:
    Tokenizer(models.WordLevel({f"t{i}": i for i in range(ids)}, unk_token="t0")).save(str(path))
    return path


def _no_config(d: Path) -> str:
    d.mkdir()
    return "has no config.json"


def _not_causal(d: Path) -> str:
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertForMaskedLM"]}))
    return "holds no causal LM"


def _missing(d: Path) -> str:
    write_tiny_model(d, "llama")
    weights = load_file(d / "model.safetensors")
    save_file({k: v for k, v in weights.items() if not k.startswith("model.layers.1.")}, d / "model.safetensors")
    return "missing 9 tensor(s): ['model.layers.1.input_layernorm.weight'"


def _misshaped(d: Path) -> str:
    write_tiny_model(d, "qwen2")
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    return "model.layers.0.mlp.down_proj.weight: [64, 128] in model.safetensors, the config makes [64, 96]"


def _mixtral_experts(d: Path) -> str:
    """The hub's per-expert files with one expert's w3 left out and another's w1 cut short."""
    write_tiny_model(d, "mixtral")
    weights = load_file(d / "model.safetensors")
    moe = "model.layers.{}.block_sparse_moe.experts.{}.{}.weight"
    del weights[moe.format(1, 3, "w3")]
    weights[moe.format(0, 2, "w1")] = weights[moe.format(0, 2, "w1")][:96]
    save_file(weights, d / "model.safetensors")
    return (f"missing 1 tensor(s): ['{moe.format(1, 3, 'w3')}']; shapes differ: "
            f"['{moe.format(0, 2, 'w1')}: [96, 64] in model.safetensors, the config makes [128, 64]']")


def _big_tokenizer(d: Path) -> str:
    write_tiny_model(d, "mistral", weights=False)
    _vocabulary(d / "tokenizer.json", 300)
    return "emits ids up to 299, beyond the model's vocabulary of 256"


@pytest.mark.parametrize("make", [_no_config, _not_causal, _missing, _misshaped, _mixtral_experts, _big_tokenizer])
def test_a_model_directory_that_cannot_train_is_refused_before_any_rank_starts(tmp_path, make):
    expected = make(tmp_path / "model")
    run = run_local(tmp_path / "run", *ClusterShape(nodes=1, nproc_per_node=1).argv(), "--steps", "2",
                    "model.source=huggingface", f"model.path={tmp_path / 'model'}", timeout=120)
    assert run.returncode == CONFIG_ERROR and expected in run.output, run.output[-2000:]
    assert not (tmp_path / "run").exists()  # nothing written


def test_the_model_directory_tokenizes_the_data_and_its_vocabulary_bounds_it(tmp_path, tiny_models):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("t1 t2 t299 t3")
    model = write_tiny_model(tmp_path / "model", "llama", weights=False, vocab_size=320)
    _vocabulary(model / "tokenizer.json", 300)
    info = prepare([corpus], model, tmp_path / "tokens.bin")  # the directory, for its tokenizer.json
    assert info["vocab_size"] == 300 and info["tokenizer"]["path"] == str(model / "tokenizer.json")
    # the same token file against the 256 ids of another model: refused before any rank starts
    run = run_local(tmp_path / "run", *ClusterShape(nodes=1, nproc_per_node=1).argv(), "--steps", "2",
                    "model.source=huggingface", f"model.path={tiny_models['llama']}",
                    f"data.path={tmp_path / 'tokens.bin'}", timeout=120)
    assert run.returncode == CONFIG_ERROR and "larger than the model's 256" in run.output
    assert not (tmp_path / "run").exists()
