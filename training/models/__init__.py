"""The models a run trains, each behind one ModelSpec (spec.py): the built-in presets (preset.py, the
Llama-style modules of llama.py) and Hugging Face causal LMs from a local directory (huggingface.py)."""
