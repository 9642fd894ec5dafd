"""``python -m benchmarks.anchor --corpus F --tokenizer DIR``: the Theus et al. table."""
import sys

from .table import main

sys.exit(main())
