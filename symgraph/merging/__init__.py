"""Merging: align N models to an anchor, then combine with a registered method.

- ``registry``  :class:`MergeMethod` and ``@register(name)``; every file here is discovered
- ``average``, ``fisher``, ``regmean``  one method each
- ``driver``    :func:`merge` and :class:`MergeResult`
"""
from __future__ import annotations

from .driver import MergeResult, merge
from .methods.registry import MergeMethod, get, names, register

merge_methods = names
register_merge = register

__all__ = ["merge", "MergeResult", "MergeMethod", "register", "register_merge", "merge_methods", "get", "names"]
