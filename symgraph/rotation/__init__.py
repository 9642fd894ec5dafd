"""Function-preserving rotations for quantization (QuaRot, SpinQuant), chosen from the symmetry
report.

- ``rotate``      :func:`~.rotate.rotate`: a model in memory rotated, with its certificate
- ``classes``     which classes a rotation acts on, an incoherent element of each, the values
- ``learned``     learned rotations (SpinQuant): elements optimised for the quantized loss
- ``outliers``    :func:`~.outliers.with_outliers`: a model of the same function with activation
  outliers at its norms' readers (what rotations are for; the benchmark's variant)
- ``stream``      :func:`~.stream.with_massive_channels`: massive residual-stream channels put
  into the token embedding (to be fine-tuned); :func:`~.stream.norm_input_ratios` measures them
- ``checkpoint``  ``symgraph rotate``: a checkpoint rotated out of core, written by
  :func:`~symgraph.app.carry.carry_writer`
"""
