import sys

from training.export.export import main

sys.exit(main())
