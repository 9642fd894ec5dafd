"""``python -m symgraph.examples [bert|gpt2|llama|vit]``: report and certify a built-in tiny model."""
from __future__ import annotations

import sys
import warnings


def build(name: str):
    """Tiny random-weight Hugging Face models (seed 0), built from configs: no download."""
    import torch
    import transformers as tf
    tf.logging.set_verbosity_error()
    torch.manual_seed(0)
    if name == "bert":
        return tf.BertForMaskedLM(tf.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                                                num_attention_heads=4, intermediate_size=64))
    if name == "gpt2":
        return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=4))
    if name == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(
            vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=64))
    if name == "vit":
        return tf.ViTForImageClassification(tf.ViTConfig(
            image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=2,
            num_attention_heads=4, intermediate_size=64, num_labels=10))
    raise SystemExit(f"unknown built-in model {name!r}; expected one of bert, gpt2, llama, vit")


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
