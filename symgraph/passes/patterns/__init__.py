"""Pattern passes over several ops.

- ``rope``        rotary position embeddings, recognised from what the graph computes
- ``rope_forms``  RoPE written other ways (complex multiplication, interleaved pairs)
- ``rope_twist``  rotary outputs that leave ``x``'s layout and meet their partners only in attention
- ``lastaxis``    where a last axis' coordinates go through slices, concatenations and reshapes
- ``norms``       RMS/LayerNorm over the last axis, and their gains folded into readers
- ``packed``      packed projections taken apart entry by entry
- ``stacked``     stacked parameters: one weight per member of a label class (experts)
"""
