"""Training data: the token file and its sidecar (`token_file`, torch-free), the deterministic, resumable
stream the ranks read (`stream`), and `python -m training.data prepare` (`prepare`)."""
