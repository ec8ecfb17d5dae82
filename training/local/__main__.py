"""`python -m training.local [--demo] …`: the emulated cluster (`cluster`)."""
import sys

from training.local.cluster import main

sys.exit(main())
