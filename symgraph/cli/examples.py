"""``python -m symgraph.cli.examples [bert|gpt2|llama|vit]``: report and certify a built-in tiny model."""
from __future__ import annotations

import sys
import warnings

__all__ = ["EXAMPLES", "build", "main"]

# name -> sizes given to symgraph.testing.models.build (Hugging Face defaults for everything else)
EXAMPLES: dict[str, dict] = {
    "bert": dict(vocab=100, hidden=32, layers=2, heads=4, mlp=64),
    "gpt2": dict(vocab=100, hidden=32, layers=2, heads=4),
    "llama": dict(vocab=100, hidden=32, layers=2, heads=4, kv_heads=2, mlp=64),
    "vit": dict(image_size=16, patch_size=4, hidden=32, layers=2, heads=4, mlp=64, num_labels=10),
}


def build(name: str):
    """Tiny random-weight Hugging Face models (seed 0, ``eval()`` mode), built from configs by
    :mod:`symgraph.testing.models`: no download."""
    if name not in EXAMPLES:
        raise SystemExit(f"unknown built-in model {name!r}; expected one of {', '.join(EXAMPLES)}")
    import transformers

    from ..testing import models
    transformers.logging.set_verbosity_error()
    return models.build(name, 0, base="hf", **EXAMPLES[name])


def main(argv=None):
    import symgraph
    warnings.filterwarnings("ignore")
    argv = sys.argv[1:] if argv is None else argv
    name = argv[0] if argv else "llama"
    model = build(name)
    report = symgraph.analyze(model)
    print(report.summary())
    print(f"\ncertificate: worst relative output change under random group elements = "
          f"{report.certify(model):.2e} (float64)")


if __name__ == "__main__":
    main()
