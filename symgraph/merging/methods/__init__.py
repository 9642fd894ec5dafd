"""Merge methods, one file each (``average``, ``fisher``, ``regmean``), registered by name in
``registry`` (:class:`MergeMethod`, ``@register``); a method declares its parameters in its
constructor (:meth:`MergeMethod.parameters`). Only this folder is scanned for methods."""
