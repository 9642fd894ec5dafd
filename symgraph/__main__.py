"""``python -m symgraph ...`` runs the ``symgraph`` command."""
from .cli.entry import main

main()
