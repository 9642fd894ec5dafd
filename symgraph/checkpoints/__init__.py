"""Checkpoint I/O.

- ``specs``      what a model argument names (a directory, a demo name, a hub id) and data files
- ``inputs``     a merge's inputs checked before any work (output, headers, data file, shard size)
- ``textdata``   a data file from text with the model's own tokenizer (``symgraph data``)
- ``layout``     where each tensor of a checkpoint lives, from the file headers alone
- ``loading``    ``from_pretrained``, complete or refused
- ``sharded``    safetensors read and written one tensor at a time, each file pinned for the run
- ``converted``  checkpoints stored as the Hub stores them (per-expert matrices, older names),
                 read and written through transformers' own conversions, one group at a time
- ``memory``     a model in memory read through the checkpoint interface (the engine's input)
- ``outdir``     the output directory: vetted, written atomically, the record and model card
- ``leftovers``  a killed run's temporary directories, marked and swept
"""
