"""`python -m memexrl ...` is the `memexrl` command."""

import sys

from memexrl.cli import main

sys.exit(main())
