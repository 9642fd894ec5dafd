"""Coverage of the whole Hugging Face library: every model class of the auto mappings for causal
LM, masked LM, sequence classification and image classification, built tiny from its own
config defaults, traced, analysed, certified and checked for completeness by structure.

One row per (model_type, class, task) of ``MODEL_FOR_{CAUSAL_LM,MASKED_LM,SEQUENCE_CLASSIFICATION,
IMAGE_CLASSIFICATION}_MAPPING_NAMES``:

1. **config**: ``CONFIG_MAPPING[model_type]()`` shrunk by one generic rule (:func:`shrink`, read
   its docstring; no per-family sizes). A config the rule cannot shrink is a row with the reason.
2. **build**: the class on that config, float32, ``eval()``, random weights (every 1-d parameter
   and every constant matrix re-drawn, as the tests do: Hugging Face's ones/zeros hide a wrong slot).
3. **run eagerly**: the model's own forward on the example inputs of
   ``symgraph.passes.inputs.default_inputs`` (no trace). What transformers cannot build (1, 2)
   or run (3) at its own default config either, failing the same way (:func:`transformers_fails`;
   a forward at full size, under fake tensors where too large: :mod:`.at_default`), is listed
   apart with its exception; the rest, our failures of 1-3 included, is the denominator
   (``runs``) of the target: sound and complete ≥ 97 % of it, per task and overall.
4. **trace + analyse**: ``symgraph.analyze(model)`` on its default inputs (timed: the analysis
   seconds of the row).
5. **certify**: ``report.certify(model)`` with an infinite tolerance so the value is always
   recorded; sound when ≤ 1e-6 (float64; ``FLOAT32_TOL`` when the model cannot run in float64).
6. **complete by structure** (:func:`expectations`, from the traced graph and the config, never
   from module names): every MLP (a linear-like op whose output reaches another linear-like op
   through elementwise ops with a nonlinearity and no residual add) has a permutation-type class
   holding the up weight's output slot and the down weight's input slot; every attention site
   (``scaled_dot_product_attention``, or a softmax over a ≥4-d score tensor) with more than one
   head has a class with head blocks on its module's weights (multi-query attention, one key
   head broadcast to all: a permutation class of the head blocks, as nothing can be per head);
   a ``rope`` class exists when the config has rotary parameters, unless every rotated query (or
   its key) is first normalised by a norm the rotations cannot pass (``rope_blocked``: the
   reason, not a miss; :mod:`.attention`). A softmax over a projection of one activation (a
   gate, hyper-connection mixing weights) is no attention site, and a query broadcast along the
   head axis (one learned query) is one head. Each missing class says what blocks it
   (``why``: the ops or patterns the analysis recorded narrowing its weights' classes, or
   keeping a head's class from varying per head; :mod:`.why`), and the table lists them.
7. **ops without a rule**: ``symgraph.cli.coverage.unruled_ops(model)``.

Each row runs in a forked child (the parent imports torch, transformers and symgraph once) under
``resource.setrlimit(RLIMIT_AS)`` and a wall-clock timeout; a failure is recorded with its
stage, exception type and first line, and the run goes on. Results: ``coverage.json`` and
``coverage.md`` in ``--out``, headed by the exact command and the commit they were made at.
"""
from __future__ import annotations

from .constants import DEFAULT_OUT, TARGET_COMPLETE, TARGET_MEDIAN_S, TARGET_RUNS, TASKS, TOL  # noqa: F401
from .attention import *  # noqa: F401,F403
from .family import *  # noqa: F401,F403
from .shrink import *  # noqa: F401,F403
from .structure import *  # noqa: F401,F403
from .summary import *  # noqa: F401,F403
