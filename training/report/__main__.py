"""`python -m training.report [--plot] RUN_DIR`."""
import sys

from training.report.goodput import main

sys.exit(main())
