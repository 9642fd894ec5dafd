"""Constants of the scale benchmark (shapes, stages, sizes, mergekit pins), its log and the
environment its child processes run in."""
from __future__ import annotations

import os

from ..provenance import REPO_ROOT, log  # noqa: F401 - log: the scale benchmark's, re-exported

#: The module the stage runner re-enters as ``python -m ENTRY --_write ...`` / ``--_read ...``
#: (the hidden flags of :func:`benchmarks.bench_scale.main`).
ENTRY = "benchmarks.bench_scale"

DEFAULT_OUT = REPO_ROOT / "benchmarks" / "results" / "scale.json"
DEFAULT_WORK = "/tmp/symgraph-scale"
GB = 1e9
SHARD_SIZE = "1GB"
MERGEKIT_VERSION = "0.1.5"
MERGEKIT_TORCH = "torch==2.13.0"  # the local CPU wheel; installed first so pip does not pull CUDA
MERGEKIT_SHARD_PARAMS = "500M"    # mergekit's --out-shard-size counts parameters (≈1 GB in bf16)

_COMMON = dict(vocab_size=32000, hidden_act="silu", rope_theta=10000.0, tie_word_embeddings=False,
               attention_bias=False, mlp_bias=False)
#: The shapes: LlamaConfig keyword arguments.
SHAPES = {
    "tiny": dict(_COMMON, hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                 rms_norm_eps=1e-5, vocab_size=4096),
    "1b": dict(_COMMON, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
               num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048,
               rms_norm_eps=1e-5),
    # 155.3 M parameters (embeddings and head 49.2 M of them): the size of the engine's memory
    # targets at a small budget (RegMean and REPAIR out of core at --memory-budget 256MB)
    "155m": dict(_COMMON, hidden_size=768, intermediate_size=2816, num_hidden_layers=12,
                 num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=2048,
                 rms_norm_eps=1e-5),
    "7b": dict(_COMMON, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
               rms_norm_eps=1e-5),
}
STAGES = ("read_cold", "read_warm", "mergekit_linear", "symgraph_none", "symgraph_weights", "symgraph_weights_exact",
          "symgraph_weights_discrete",
          "symgraph_weights_tol", "symgraph_activations", "symgraph_regmean", "symgraph_fisher", "symgraph_repair",
          "symgraph_weights_baseline")
BASELINE = "symgraph_weights_baseline"  # symgraph_weights' command run from another commit's tree
DATA_ROWS, DATA_TOKENS = 32, 128  # symgraph_activations' data: 4 batches of 8 rows



def _env(**extra) -> dict:
    env = dict(os.environ, TRANSFORMERS_VERBOSITY="error", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.update(extra)
    return env
