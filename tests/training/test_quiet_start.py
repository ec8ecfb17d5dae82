"""No noise on start: NVRx imports pynvml in every process, and must find the maintained binding
(nvidia-ml-py's module), not the deprecated `pynvml` shim that warns on each import."""
from __future__ import annotations

import subprocess
import sys

from training_helpers import REPO_ROOT


def test_nvrx_and_pynvml_import_without_a_warning():
    code = ("import pynvml; from nvidia_resiliency_ext.shared_utils import health_check; "
            "import nvidia_resiliency_ext.fault_tolerance; print(pynvml.__file__)")
    proc = subprocess.run([sys.executable, "-W", "error::FutureWarning", "-W", "error::DeprecationWarning:pynvml",
                           "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert proc.stdout.strip().endswith("/pynvml.py")  # nvidia-ml-py's single module, not the shim package
