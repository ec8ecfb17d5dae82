#!/usr/bin/env bash
# The bench on one GPU (H100/H200): the 1b preset in one NCCL process (NCCL refuses two ranks on one
# device), sync vs NVRx async checkpoint blocking (training/checkpoint.py's async_ckpt path), and
# in-process vs in-job recovery; writes bench/results/<date>_gpu.{json,md,png}, the same schema as
# `make bench`. About 5-8 minutes on an H200; needs about 35 GB of free disk (15 GB per 1b checkpoint).
#
# Needs: torch with CUDA, nvidia-resiliency-ext (ft_launcher, async_ckpt), psutil, pyyaml,
# matplotlib. PYTHON picks the interpreter (default: .venv/bin/python if present, else python3).
#
# Without a CUDA device it measures nothing: it prints "no CUDA device" and exits 2, so that no
# caller mistakes a CPU machine's run for GPU figures. Extra arguments go to `python -m bench.run`.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
if ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "bench/gpu.sh: no CUDA device visible to $PYTHON (torch.cuda.is_available() is False, or torch is" \
         "missing): nothing measured. Run it on a GPU machine; on CPU use \`make bench\`." >&2
    exit 2
fi
if ! "$PYTHON" -c 'import nvidia_resiliency_ext.checkpointing.async_ckpt' 2>/dev/null; then
    echo "bench/gpu.sh: nvidia-resiliency-ext is not importable by $PYTHON: ft_launcher and the async_ckpt" \
         "path need it; nothing measured." >&2
    exit 2
fi
export PYTHONWARNINGS="${PYTHONWARNINGS:-ignore::FutureWarning}"
exec "$PYTHON" -m bench.run --gpu "$@"
