"""`python -m training.data prepare …`: text and JSONL to a token file (`prepare`)."""
import sys

from training.data.prepare import main

sys.exit(main())
