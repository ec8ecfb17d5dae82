"""`python -m training.plan …`."""
import sys

from training.plan.cli import main

sys.exit(main())
