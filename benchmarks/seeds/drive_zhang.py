"""Zhang et al. (ICML 2025), "Beyond the Permutation Symmetry of Transformers: The Role of Rotation
for Model Fusion": their code merges the suite's BERT pair. Runs in their venv
(``PYTHON drive_zhang.py --code DIR --job DIR``).

What their ``src/run_experiments.py`` does with ``merger.algo: pi`` (``--use_pi``), on our parents:
their ``PermutationInvarianMerger`` (``src/model_merge/pi_merger.py``), configured by the merger
block of their ``src/configs/defaults.yaml`` overlaid with their published
``src/configs/exps/roberta-base/roberta-pi.yaml``, whose module patterns (BERT's, RoBERTa being
BERT's code) must match every layer of both parents. Then, as their ``merge_to_global``:
``match_ffns`` (``Permute_IO``: Hungarian on the MLP units' weights) and ``match_attentions``
(``Chunk_SVD_QK``/``Chunk_SVD_VO``: an orthogonal Procrustes rotation per block of Q/K and of V/O
rows) with B as the local model and A as the anchor (their nearest-to-the-average rule is a tie
for two models), then ``avg_merge`` (λ = 0.5) into a copy of A. Data-free: the alignment batches
only check the exchange.

Their ``match_attention`` calls the helpers without a head size, so their default of 64 rows per
block (BERT-base's head size) applies whatever the model's heads; the driver records what their
BERT helpers do given our head size, and what each transformed B computes against B. Variants
(``per_head``, ``per_head_rescale``): the helpers of their later ``vit-fusion/otfusion/pi_utils.py``
(each block's own bias, the head count and size as arguments, optional scalar rescaling) called
with our heads through the merger's own ``update_attentions``.
"""
from __future__ import annotations

import copy
import importlib.util
import time

import torch
from safetensors.torch import load_file

import driver_common as dc

#: Their configuration files, in the order their loader overlays them (merger block only).
CONFIGS = ("src/configs/defaults.yaml", "src/configs/exps/roberta-base/roberta-pi.yaml")
#: Their later helpers, which take the head count and size (``vit-fusion``).
VIT_HELPERS = "vit-fusion/otfusion/pi_utils.py"
#: Rows per rotation block of their BERT helpers when given no head size (their default).
THEIR_BLOCK = 64
#: What their ``avg_merge`` reads of a local model's config (anything but "multi_label").
TASK_TYPE = "mlm"
#: the variants beside their merge as published (VARIANTS[name]: what each is)
VARIANTS = {
    "per_head": "their vit-fusion helpers (Chunk_SVD_QK/VO, each head's own bias) called with our "
                "heads' count and size, in place of pi_merger's defaults (blocks of 64)",
    "per_head_rescale": "as per_head with their use_scaling=True (a scalar per head and per QK / VO "
                        "pair after its rotation)",
}


def merger_config(code):
    """Their merger configuration: defaults.yaml's merger block overlaid with roberta-pi.yaml's."""
    import yaml
    from src.utils.config import dic_to_object, merge_config_dict
    merged = {}
    for f in CONFIGS:
        merge_config_dict(merged, {"merger": yaml.safe_load((code / f).read_text())["merger"]})
    return dic_to_object(merged["merger"]), merged["merger"]


def pattern_matches(model, patterns: dict) -> dict:
    """``{pattern name: modules of model whose name their check_module_name_by_regex takes}``."""
    from src.model_merge.misc import check_module_name_by_regex
    return {k: [n for n, _ in model.named_modules() if check_module_name_by_regex(n, p["pi_filter_regex"])]
            for k, p in patterns.items()}


def check_patterns(models, plain: dict, layers: int) -> dict:
    """Every attention and FFN pattern matches exactly one module per layer in each model; else exit."""
    counts = {}
    for kind in ("attn_patterns", "ffn_patterns"):
        for m in models:
            for k, names in pattern_matches(m, plain[kind]).items():
                if len(names) != layers:
                    raise SystemExit(f"their {kind}.{k} matches {len(names)} modules, not one per layer "
                                     f"({layers}): {names[:4]}")
                counts[f"{kind}.{k}"] = len(names)
    return counts


def wrapped(model):
    """``model`` as their ``TmpLocalModel`` with the ``model_config.task_type`` their LocalModel has."""
    from src.model_merge.pi_merger import TmpLocalModel
    from src.utils.config import dic_to_object
    w = TmpLocalModel(copy.deepcopy(model))
    w.model_config = dic_to_object({"task_type": TASK_TYPE})
    return w


def vit_helpers(code):
    """Their vit-fusion ``pi_utils`` module, loaded from its file under a name of its own."""
    spec = importlib.util.spec_from_file_location("zhang_vit_pi_utils", code / VIT_HELPERS)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def their_merge(a, b, cfg, helpers=None, **kw):
    """Their matching of B (local) to A (anchor), then their average: (merged model, transformed B).
    With ``helpers``, the merger's ``match_attention`` calls their Chunk_SVD_QK/VO with ``kw`` (our
    heads) and applies the result through its own ``update_attentions``."""
    from src.model_merge.pi_merger import PermutationInvarianMerger
    from src.model_merge.pi_utils import get_QKVO
    anchor, local, merged = wrapped(a), wrapped(b), wrapped(a)
    merger = PermutationInvarianMerger(None, cfg, [anchor, local], merged)

    def match_attention(local_module, anchor_module, attn_pattern):
        lp, ap = get_QKVO(local_module, attn_pattern), get_QKVO(anchor_module, attn_pattern)
        qk, vo = helpers.Chunk_SVD_QK(lp, ap, **kw), helpers.Chunk_SVD_VO(lp, ap, **kw)
        merger.update_attentions(local_module, qk, vo, attn_pattern)
    if helpers is not None:
        merger.match_attention = match_attention
    merger.match_ffns(local, anchor)
    merger.match_attentions(local, anchor)
    merger.avg_merge(merger.local_models, merger.global_model)
    return merged.base, local.base


def merges(a, b, cfg, helpers, logits, ref_b, names: set) -> tuple[dict, dict, dict]:
    """Their merge as published (key ``None``) and each of :data:`VARIANTS`: ``(states restricted
    to the exchanged checkpoint's ``names``, seconds, max |logit difference| of the transformed B
    against B)``."""
    heads = a.config.num_attention_heads
    ours = {"num_attention_heads": heads, "attention_head_size": a.config.hidden_size // heads}
    runs = {None: {}, "per_head": dict(ours, helpers=helpers, use_scaling=False),
            "per_head_rescale": dict(ours, helpers=helpers, use_scaling=True)}
    out, seconds, b_check = {}, {}, {}
    for name, kw in runs.items():
        t = time.perf_counter()
        with torch.no_grad():
            merged, b_t = their_merge(a, b, cfg, **kw)
            seconds[name] = time.perf_counter() - t
            key = name or f"pi_merger (as published: blocks of {THEIR_BLOCK} rows)"
            b_check[key] = float((logits(b_t) - ref_b).abs().max())
        out[name] = {k: v for k, v in merged.state_dict().items() if k in names}
        if names - set(out[name]):
            raise SystemExit(f"their merged model lacks {sorted(names - set(out[name]))[:5]}")
    return out, seconds, b_check


def notes(a, b, cfg, heads: int, size: int) -> tuple[str, list]:
    """What their BERT ``Chunk_SVD_QK`` does given our head count and size (on the first layer),
    and the notes the report prints."""
    from src.model_merge.pi_utils import Chunk_SVD_QK, get_QKVO
    p = vars(cfg.attn_patterns)["pattern0"]
    first = pattern_matches(a, {"p": {"pi_filter_regex": p.pi_filter_regex}})["p"][0]
    at_size = "ran"
    try:
        with torch.no_grad():
            Chunk_SVD_QK(get_QKVO(b.get_submodule(first), p), get_QKVO(a.get_submodule(first), p),
                         num_attention_heads=heads, attention_head_size=size)
    except Exception as e:  # their code's own error, recorded as it reads
        at_size = f"{type(e).__name__}: {e}"
    return at_size, [
        f"their pi_merger calls Chunk_SVD_QK/VO with no head size, so the helpers' default of {THEIR_BLOCK} "
        f"rows (BERT-base's head size) applies: {a.config.hidden_size // THEIR_BLOCK} rotation block(s) of "
        f"{THEIR_BLOCK} rows per layer over our {heads} heads of {size} (a rotation across heads is no "
        f"symmetry of multi-head attention)",
        f"their BERT helpers (src/model_merge/pi_utils) given our head count and size: {at_size} (their "
        f"bias term is the whole layer's bias outer product, not the block's)"]


def main() -> None:
    from transformers import BertConfig, BertForMaskedLM
    code, job_dir, job = dc.arguments(__doc__)
    dc.on_path(code)
    cfg, plain = merger_config(code)
    ids = load_file(str(job_dir / "batches.safetensors"))["input_ids"]
    a, b = dc.parents(job_dir, BertForMaskedLM, BertConfig)
    x = ids[: job["reference_rows"]]
    logits = lambda m: m(input_ids=x).logits  # noqa: E731
    diffs = dc.check_logits(job_dir, {"a": a, "b": b}, logits)
    matched = check_patterns([a, b], plain, a.config.num_hidden_layers)
    names = set(load_file(str(job_dir / "a" / "model.safetensors")))
    ref_b = load_file(str(job_dir / "reference.safetensors"))["b"]
    out, seconds, b_check = merges(a, b, cfg, vit_helpers(code), logits, ref_b, names)
    for v in VARIANTS:
        dc.save_variant(job_dir, v, out[v])
    heads = a.config.num_attention_heads
    at_size, lines = notes(a, b, cfg, heads, a.config.hidden_size // heads)
    dc.write(job_dir, out[None], {
        "seconds": seconds[None], "variant_seconds": {v: seconds[v] for v in VARIANTS},
        "configs": list(CONFIGS), "merger": plain, "patterns_matched": matched, "anchor": "a",
        "heads": heads, "head_size": a.config.hidden_size // heads,
        "their_block_rows": THEIR_BLOCK, "bert_helpers_at_our_head_size": at_size, "notes": lines,
        "parent_logit_diff": diffs, "shims": [], "b_transformed_logit_diff": b_check,
        "b_check_what": "their transformed B against B", "sequences": int(ids.shape[0]), "variants": VARIANTS})


if __name__ == "__main__":
    main()
