"""Tiny Hugging Face model directories written from a config alone (nothing downloaded): what the tests
and `make demo-hf` train. A few seconds per step on a CPU core, like the tiny preset."""
from __future__ import annotations

from pathlib import Path

import torch

# transformers config classes and the tiny shape they share: 2 layers of width 64, grouped-query attention.
TINY_SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=1024)
FAMILIES = ("llama", "qwen2", "mistral", "mixtral")  # what trains here, from its own safetensors too
# mixtral: a mixture of experts, each layer's feed-forward 4 experts of which a token goes through 2; its
# safetensors hold them one by one, as the hub's do (save_pretrained's default layout, `hub_layout`).
FAMILY_SHAPES = {**{family: {} for family in FAMILIES}, "mixtral": dict(num_local_experts=4, num_experts_per_tok=2)}


def write_tiny_model(directory: str | Path, family: str = "llama", weights: bool = True, seed: int = 0,
                     **overrides) -> Path:
    """A `family` causal LM's config.json in `directory` and, with `weights`, its seeded weights as
    model.safetensors (the pretrained weights a run starts from)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils.logging import disable_progress_bar

    disable_progress_bar()  # a bar for a file of a few hundred KB is noise

    config = AutoConfig.for_model(family, **{**TINY_SHAPE, **FAMILY_SHAPES[family], **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    config.architectures = [type(model).__name__]
    directory = Path(directory)
    if weights:
        model.save_pretrained(directory)
    else:
        config.save_pretrained(directory)
    return directory
