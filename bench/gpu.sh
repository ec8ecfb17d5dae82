#!/usr/bin/env bash
# The checks and the bench on one GPU (H100/H200). First the exact-resume check (bench/resume.py,
# about a minute): a tiny run with NVRx async checkpoints and an injected exception must end bitwise
# equal to the same run uninterrupted. Then the bench: the 1b preset in one NCCL process (NCCL
# refuses two ranks on one device), sync vs NVRx async checkpoint blocking (the async_ckpt path of
# training/train/checkpoint/writers.py), and in-process vs in-job recovery; writes
# bench/results/<date>_gpu.{json,md,png}, the same schema as `make bench`. About 5-8 minutes on an
# H200; needs about 35 GB of free disk (15 GB per 1b checkpoint). The last line repeats the check's
# verdict: "exact resume on CUDA: PASS" or "... FAIL"; the exit status is 1 when the check failed,
# else the bench's.
#
# Needs: torch with CUDA, nvidia-resiliency-ext (ft_launcher, async_ckpt), psutil, pyyaml,
# matplotlib. PYTHON picks the interpreter (default: .venv/bin/python if present, else python3).
#
# Without a CUDA device it measures nothing: it prints "no CUDA device" and exits 2, so that no
# caller mistakes a CPU machine's run for GPU figures. `--resume-only` runs the check alone; other
# arguments go to `python -m bench.run`.
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
resume_status=0
"$PYTHON" -m bench.resume || resume_status=$?
if [[ "${1:-}" == --resume-only ]]; then
    exit "$resume_status"
fi
bench_status=0
"$PYTHON" -m bench.run --gpu "$@" || bench_status=$?
if (( resume_status == 0 )); then verdict=PASS; else verdict="FAIL (see bench.resume's line above)"; fi
echo "bench/gpu.sh: exact resume on CUDA: $verdict; bench exit status $bench_status"
if (( resume_status != 0 )); then exit 1; fi
exit "$bench_status"
