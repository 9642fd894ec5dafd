"""Checkpoint I/O: ``specs`` (what a model argument names: a directory, a demo name, a hub id;
data files), ``loading`` (``from_pretrained``, complete or refused), ``sharded`` (safetensors
read and written one tensor at a time) and ``outdir`` (the output directory: vetting, atomic
writes, what symgraph wrote, the model card)."""
