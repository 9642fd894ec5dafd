"""Changing a model's width: resize (optimal transport onto other widths) and widen (a traced program with wider heads)."""
