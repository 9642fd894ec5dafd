"""Pattern passes over several ops: RoPE (``rope``), RMS/LayerNorm and their foldable gains
(``norms``), packed projections (``packed``), stacked expert weights (``stacked``)."""
