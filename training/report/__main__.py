"""`python -m training.report [--plot] RUN_DIR` (`cli`)."""
import sys

from training.report.cli import main

sys.exit(main())
