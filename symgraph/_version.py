"""The package version (its own module: importing it loads nothing else)."""
__version__ = "0.1.0"
