"""`python -m training.models check DIR`: the refusals of a Hugging Face model directory, the torch-free
ones (training.contract.model_source) and those that need the model built on the meta device (its
*.safetensors' names and shapes), for a caller that imports no torch: training.local, before any rank starts.
Exit 0 with the model's shape, or CONFIG_ERROR with the reason on stderr.

`python -m training.models tiny DIR [--family llama|qwen2|mistral|mixtral] [--no-weights]`: a tiny Hugging Face
model directory written from its config (`tiny`), for trying the Hugging Face path without a download."""
from __future__ import annotations

import sys

from training.contract.config import ConfigArgumentParser
from training.contract.exit_codes import CONFIG_ERROR
from training.contract.model_source import ModelSourceError
from training.models.tiny import FAMILIES, write_tiny_model


def main(argv: list[str] | None = None) -> int:
    parser = ConfigArgumentParser(prog="python -m training.models", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="refuse a model directory that cannot train")
    check.add_argument("directory")
    tiny = sub.add_parser("tiny", help="write a tiny Hugging Face model directory (config.json, model.safetensors)")
    tiny.add_argument("directory")
    tiny.add_argument("--family", choices=FAMILIES, default="llama")
    tiny.add_argument("--no-weights", dest="weights", action="store_false", help="config.json only")
    args = parser.parse_args(argv)
    if args.command == "tiny":
        print(write_tiny_model(args.directory, args.family, args.weights))
        return 0
    try:
        from training.models.huggingface import HuggingFaceSpec

        spec = HuggingFaceSpec(args.directory)
        spec.check_weights()
    except ModelSourceError as err:
        print(err, file=sys.stderr)
        return CONFIG_ERROR
    print(spec.shape)
    return 0


if __name__ == "__main__":
    sys.exit(main())
