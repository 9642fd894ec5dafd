"""Coverage of the whole Hugging Face library: every model class of the auto mappings of
:data:`.family.TASKS` (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``, ...), built tiny from its own config
defaults, traced, analysed, certified and checked for completeness by structure. One row per
(model_type, class, task):

1. **config**: ``CONFIG_MAPPING[model_type]()`` shrunk by one generic rule (:func:`.shrink.shrink`;
   no per-family sizes). A config the rule cannot shrink is a row with the reason.
2. **build**: the class on that config, float32, ``eval()``, random weights (every 1-d parameter
   and every constant matrix re-drawn: Hugging Face's ones/zeros hide a wrong slot).
3. **run eagerly**: the model's own forward on the example inputs of
   ``symgraph.passes.inputs.default_inputs``. What transformers cannot build (1, 2) or run (3) at
   its own default config either, failing the same way (:func:`.family.transformers_fails`), is
   listed apart; the rest, our failures of 1-3 included, is the denominator (``runs``) of the
   target: sound and complete ≥ 97 % of it, per task and overall.
4. **trace + analyse**: ``symgraph.analyze(model)`` on its default inputs (timed).
5. **certify**: ``report.certify(model)`` with an infinite tolerance so the value is always
   recorded; sound when ≤ 1e-6 (float64; ``FLOAT32_TOL`` when the model cannot run in float64).
6. **complete by structure** (:func:`.structure.expectations`, from the traced graph and the
   config, never from module names): every MLP (a linear-like op reaching another through
   elementwise ops with a nonlinearity and no residual add) has a permutation-type class holding
   the up weight's output slot and the down weight's input slot; every attention site
   (``scaled_dot_product_attention``, or a softmax over a ≥4-d score tensor that is no projection
   of one activation) with more than one head has a class with head blocks on its module's
   weights (multi-query: a permutation class of the head count); a ``rope`` class exists when
   the config has rotary parameters, unless every rotated query (or key) is normalised by a norm
   the rotations cannot pass (``rope_blocked``: :mod:`.attention`). Each missing class says what
   blocks it (``why``: :mod:`.why`).
7. **ops without a rule**: ``symgraph.cli.coverage.unruled_ops(model)``.

Each row runs in a forked child under ``RLIMIT_AS`` and a wall-clock timeout; a failure is
recorded with its stage, exception type and first line, and the run goes on. Results:
``coverage.json`` and ``coverage.md`` in ``--out``, headed by the command and the commit.
"""
from __future__ import annotations

from .attention import *  # noqa: F401,F403
from .family import *  # noqa: F401,F403
from .shrink import *  # noqa: F401,F403
from .structure import *  # noqa: F401,F403
from .summary import *  # noqa: F401,F403
