"""`python -m training.local [--demo] …`: the emulated cluster (`cli`, `cluster`)."""
import sys

from training.local.cli import main

sys.exit(main())
