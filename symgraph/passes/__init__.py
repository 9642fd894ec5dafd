"""Analysis passes: ``torch.export`` traces the model, per-op rules and pattern passes say how
axes relate, a union-find merges them into classes. Importing the rule files registers their rules.

- ``trace``             ``torch.export`` into an ATen graph
- ``driver``            axis variables for every tensor, the rules and passes run, classes found
- ``registry``          the constraint algebra and the rule table
- ``unionfind``         union-find over axis variables: duality parity, group kinds, structure
- ``fibres``            which classes are fibred over which (heads over head permutations)
- ``rules``             per-op rules, one file per op family
- ``patterns``          pattern passes over several ops (RoPE, norms, packed, stacked)
- ``nodes``             graph helpers: op packets, the nodes an argument mentions, provenance
- ``labels``            label tensors: integer values that are coordinates of an axis class
- ``masks``             activations that may hold an additive mask's fill (never read)
- ``uniform``           axes along which a constant does not vary (T5's cross-attention bias)
- ``bufferviews``       buffers viewed or cropped before they are added to activations
- ``concrete``          concrete sizes for data-dependent values (a mask's selection)
- ``rows``              the vocabulary rows an input picks and an output produces
- ``axes``              queries on a finished analysis (an element's matrix along an axis)
- ``sites``             where a graph computes attention (SDPA ops, or attention written out)
- ``channels``          the channels REPAIR corrects: linear or conv outputs that reach a nonlinearity
- ``blockmaps``         a head axis' map as blocks
- ``why``               why an axis's classes are what they are
- ``inputs``            example inputs from a Hugging Face config and forward signature
- ``input_values``      the config values example inputs are built from (sizes, token ids)
- ``optional_inputs``   optional inputs that read parameters the main input leaves unread
- ``holder_inputs``     a called module's optional argument that reads a parameter, run in the trace
- ``entry_points``      another method of the model that reads a parameter, run beside the forward
- ``training_runs``     a module that reads a parameter only in training mode, run again so in the trace
- ``deadcode``          unread parameters no method of their module's source reads (a static proof)
- ``closed_reads``      unread parameters read only on a path every call of their holder closes (static)
- ``member_uses``       where a module's member is used, read from its holders' sources (for closed_reads)
- ``image_inputs``      a vision-language model's images and image tokens
- ``image_processing``  images made by the model's own image processor from transformers
- ``tower_inputs``      image layouts for towers the others do not fit (tokens' own pixels)
- ``patch_inputs``      Pix2Struct-style flattened patches, as the main input or beside text
- ``audio_inputs``      audio: raw samples, features, a speech model's audio tokens
- ``paired_inputs``     inputs a forward needs beside its main one (text beside images, languages)
- ``policy_inputs``     a vision-language-action policy's state, cameras and the draws it would make
- ``shared_inputs``     a draft model's target states (key/value states and hidden states it reads)
- ``export_inputs``     the values transformers' exporter precomputes for a trace (vision segments)
- ``experts``           the experts implementation a mixture-of-experts block is run and traced under
- ``real_values``       a trace with the values the data decides taken from a real run
- ``index_lists``       indices given as sequences of 0-dim tensors, stacked while tracing
- ``output_caches``     a model's output taken without the transformers caches it returns
- ``diffusion_inputs``  example inputs for diffusers models
"""
from .rules import attention, matrix, pointwise, pooling, reductions, segments, views  # noqa: F401
from . import labels  # noqa: F401
from .driver import AxisAnalysis, analyze_graph  # noqa: F401
from .registry import has_rule, lookup, observed, register  # noqa: F401

__all__ = ['AxisAnalysis', 'analyze_graph', 'has_rule', 'lookup', 'register', 'observed']
