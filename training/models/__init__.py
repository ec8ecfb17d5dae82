"""The models a run trains, each behind one ModelSpec (`spec`): the built-in presets (`preset`, the
Llama-style modules of `llama`) and Hugging Face causal LMs from a local directory (`huggingface`)."""
