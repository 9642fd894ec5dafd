"""Evaluating merges.

- ``barrier``  the loss along the linear path between two models (:func:`~.barrier.interpolate`)
  and the loss barrier (:func:`~.barrier.loss_barrier`), in memory or streamed
"""
