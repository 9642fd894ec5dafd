"""Merge methods, one file each (``average``, ``fisher``, ``regmean``), registered by name in
``registry`` (:class:`MergeMethod`, ``@register``); a method declares its parameters as a
``Parameters`` model. Only this folder is scanned for methods."""
