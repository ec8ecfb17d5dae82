"""`python -m training.plan …`."""
import sys

from training.plan.planner import main

sys.exit(main())
