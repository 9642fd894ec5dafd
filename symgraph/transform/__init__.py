"""Applying group elements to weights: the one walk (``apply``) and norm-gain folding (``folding``)."""
from .apply import transform  # noqa: F401
