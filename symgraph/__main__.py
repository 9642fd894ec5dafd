"""``python -m symgraph ...`` runs the ``symgraph`` command."""
import sys

from .cli.main import main

sys.exit(main())
