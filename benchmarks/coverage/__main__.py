"""``python -m benchmarks.coverage``: see the package docstring."""
import sys

from .summary import main

sys.exit(main())
