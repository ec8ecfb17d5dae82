"""Training data: the token file and its sidecar (token_file.py, torch-free), the deterministic, resumable
stream the ranks read (stream.py), and `python -m training.data prepare` (prepare.py)."""
