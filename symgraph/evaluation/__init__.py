"""Evaluating merges: interpolation and loss barriers."""
