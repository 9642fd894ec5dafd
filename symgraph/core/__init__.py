"""Values every stage shares.

- ``groups``       the group lattice of axis classes, and sampling of group elements
- ``elements``     group elements as index vectors and small blocks, and their action on a tensor axis
- ``gemm``         the large float32 products of alignment and merging (oneDNN)
- ``hadamard``     Hadamard matrices and the incoherent rotations built from them
- ``distributed``  sums of statistics over processes (``torch.distributed``)
- ``finite``       the finiteness checks of weights, configs and statistics
- ``files``        files by identity: input files pinned for a run, only our own files deleted
- ``dtypes``       the safetensors dtype names and their torch dtypes
- ``ties``         tied parameters kept tied where PyTorch would split them
- ``configs``      what models' configs differ in: their classes, and the fields a late refusal names
- ``schema``       one line for a value a schema refuses; flags derived from a schema's fields
- ``devices``      the devices symgraph computes on, checked to hold a tensor before any work
- ``modes``        a model's train/eval flag set as torch sets it (no model's own override)
- ``progress``     progress bars on stderr, and ``--quiet``
"""
