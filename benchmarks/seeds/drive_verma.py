"""Verma & Elbayad (2024), "Merging Text Transformer Models from Different Initializations": their
code merges the suite's BERT pair. Runs in their venv (``PYTHON drive_verma.py --code DIR --job DIR``).

What their ``experiment/merge_bert_classifiers.py`` does for ``--task mlm --bsz 8 --special-toks
--permute-heads --no-absval --merge-type all --res-type all --merging-fn match_tensors_permute``
(every component, one residual permutation from all residual points, their ``configs/bert_books.py``
metric: covariance), on our parents and token blocks: their graph of BERT
(``graphs.transformer_enc_graph.bert``, its layer and head counts, fixed at BERT-base's 12 and 12,
set to our model's), their ``ModelMerge.transform`` on the alignment blocks in batches of 8 (all
of one length: no padding). Model 0 is our A (the space merged into), model 1 our B.

The λ = 0.5 model is built as their ``evaluation/graphing_mlm.py --unmerge`` builds it: every
entry the average, and the output projection untied, ``½ W_A + ½ W_B' U`` with their ``unmerge``
matrix U (the residual permutation reaches the tied word embeddings but not the MLM head's input).
The state written has the decoder's weight and bias apart from the word embeddings and the head's bias.
"""
from __future__ import annotations

import copy
import time

import torch
from safetensors.torch import load_file

import driver_common as dc

#: Their command-line flags for the full merge (see the module docstring).
FLAGS = {"bsz": 8, "special_toks": True, "permute_heads": True, "ignore_heads": False, "no_absval": True,
         "merge_type": "all", "res_type": "all", "merging_fn": "match_tensors_permute", "qk": False,
         "merge_cls": False, "save_both": False, "sentence_level": None}
DECODER = "cls.predictions.decoder.weight"
#: What their evaluation gives the decoder of its own: the weight above and its bias (their
#: ``PermAllTrainer`` adds ``cls.predictions.decoder.bias``).
UNTIED = (DECODER, "cls.predictions.decoder.bias")


def graphs(models, cfg):
    """Their BERT graph of each model, with our model's layer and head counts."""
    from graphs.transformer_enc_graph import bert
    out = []
    for m in models:
        g = bert(m, merge_type=FLAGS["merge_type"], qk=FLAGS["qk"], classifier=False)
        g.num_layers, g.num_heads = cfg.num_hidden_layers, cfg.num_attention_heads
        out.append(g.graphify())
    return out


def their_merge(a, b, ids, config):
    """Their ``ModelMerge.transform`` with :data:`FLAGS`: (the merger, their ``unmerge`` matrix)."""
    from transformers import BertForMaskedLM

    from model_merger import ModelMerge
    from metric_calculators import get_metric_fns
    from utils import get_merging_fn
    bsz = FLAGS["bsz"]
    loader = [(ids[i:i + bsz], tuple([ids.shape[1]] * len(ids[i:i + bsz]))) for i in range(0, len(ids), bsz)]
    merge = ModelMerge(*graphs([copy.deepcopy(a), copy.deepcopy(b)], a.config), device="cpu")
    unmerge, _ = merge.transform(
        BertForMaskedLM(a.config), [loader], sentence_level=FLAGS["sentence_level"],
        special_toks=FLAGS["special_toks"], transform_fn=get_merging_fn(FLAGS["merging_fn"]),
        metric_classes=get_metric_fns(config["merging_metrics"]), permute_heads=FLAGS["permute_heads"],
        ignore_heads=FLAGS["ignore_heads"], save_both=FLAGS["save_both"], merge_cls=FLAGS["merge_cls"],
        no_absval=FLAGS["no_absval"], saved_features=None, res_type=FLAGS["res_type"])
    return merge, unmerge


def untied_logits(m, x, decoder):
    """``m``'s MLM logits with ``decoder`` as its output projection (their ``PermAllTrainer``'s
    forward)."""
    h = m(input_ids=x, output_hidden_states=True)["hidden_states"][-1]
    return torch.nn.functional.linear(m.cls.predictions.transform(h), decoder) + m.cls.predictions.decoder.bias


def main() -> None:
    from transformers import BertConfig, BertForMaskedLM
    code, job_dir, job = dc.arguments(__doc__)
    dc.on_path(code)
    from utils import get_config_from_name
    config = get_config_from_name("bert_books", device="cpu")
    ids = load_file(str(job_dir / "batches.safetensors"))["input_ids"]
    a, b = dc.parents(job_dir, BertForMaskedLM, BertConfig)
    x = ids[: job["reference_rows"]]
    diffs = dc.check_logits(job_dir, {"a": a, "b": b}, lambda m: m(input_ids=x).logits)
    torch.manual_seed(0)  # their script's seeding
    t = time.perf_counter()
    with torch.no_grad():
        merge, unmerge = their_merge(a, b, ids, config)
        d1, d2 = merge.graphs[0].model.state_dict(), merge.graphs[1].model.state_dict()
        mid = {k: 0.5 * d1[k] + 0.5 * d2[k] for k in d1}
        mid[DECODER] = 0.5 * d1[DECODER] + 0.5 * d2[DECODER] @ unmerge
        restored = 0.5 * d1[DECODER] + 0.5 * d2[DECODER] @ unmerge.T
        seconds = time.perf_counter() - t
        ref = b(input_ids=x).logits  # their transformed B with each untied decoder, against B
        b_check = {how: float((untied_logits(merge.graphs[1].model, x, d2[DECODER] @ u) - ref).abs().max())
                   for how, u in (("W_B' U (their graphing_mlm.py)", unmerge), ("W_B' U^T", unmerge.T))}
    names = set(load_file(str(job_dir / "a" / "model.safetensors")))  # the exchanged checkpoint's
    if names - set(mid):
        raise SystemExit(f"their merged model lacks {sorted(names - set(mid))[:5]}")
    state = {k: v for k, v in mid.items() if k in names or k in UNTIED}
    dc.save_variant(job_dir, "decoder_restored", {DECODER: restored})
    dc.write(job_dir, state, {
        "seconds": seconds, "flags": FLAGS, "metrics": config["merging_metrics"], "sequences": int(ids.shape[0]),
        "parent_logit_diff": diffs, "untied": list(UNTIED), "shims": [],
        "b_transformed_logit_diff": b_check,
        "variants": {"decoder_restored": "decoder ½ W_A + ½ W_B' Uᵀ, which gives their transformed B exactly "
                                         "B's function (their graphing_mlm.py applies U, not Uᵀ)"}})


if __name__ == "__main__":
    main()
