"""`python -m training.export`: a run's model as safetensors in its Hugging Face layout (`export`)."""
