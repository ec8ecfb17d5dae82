"""`python -m training.train --config FILE [section.key=value …]`: one rank (started by ft_launcher)."""
import sys

from training.train.trainer import main

sys.exit(main())
