"""Whether the models of a merge can be merged, from their configs, before any work: one
architecture, one configuration apart from the sizes an alignment can bridge, one depth; and
what their configs differ in, for a refusal found later."""
from __future__ import annotations

from ..core.finite import same_value
from ..errors import InputError

__all__ = ["check_same_family", "check_same_configs", "config_diff", "width_change", "METADATA", "NOT_FUNCTION"]


def check_same_family(models, names):
    """Refuse models of different classes before any work, naming them."""
    classes = [type(m).__name__ for m in models]
    for name, cls in zip(names[1:], classes[1:]):
        if cls != classes[0]:
            raise InputError(f"{names[0]!r} is a {classes[0]} but {name!r} is a {cls}; expected models of "
                             "one architecture")


#: Config fields that do not change what a model computes in evaluation.
METADATA = {"_name_or_path", "architectures", "transformers_version", "dtype", "torch_dtype", "_commit_hash"}
NOT_FUNCTION = METADATA | {"use_cache", "return_dict", "output_attentions", "output_hidden_states", "torchscript",
                 "id2label", "label2id", "tokenizer_class", "task_specific_params", "finetuning_task", "prefix",
                 "initializer_range", "initializer_factor", "attn_implementation", "_attn_implementation",
                 "_attn_implementation_autoset", "problem_type"}


def check_same_configs(configs, names):
    """Refuse, before any work, models whose configs differ in a field that changes the function
    but not the tensors' shapes (an activation, a RoPE base, a norm epsilon, a flag): the merged
    model would silently follow the anchor's. Integer fields (sizes) are left to the shape
    checks, which know which widths an alignment can bridge; dropout rates do not count."""
    if any(c is None for c in configs):
        return
    base = configs[0].to_dict()
    for name, c in zip(names[1:], configs[1:]):
        d = c.to_dict()
        kinds = [(x.get("architectures") or [x.get("model_type")])[0] for x in (base, d)]
        if kinds[0] != kinds[1]:
            raise InputError(f"{names[0]!r} is a {kinds[0]} but {name!r} is a {kinds[1]}; expected models of "
                             "one architecture")
        for k in sorted(set(base) | set(d)):
            a, b = base.get(k), d.get(k)
            if k in NOT_FUNCTION or same_value(a, b) or "dropout" in k or "pdrop" in k:
                continue
            if isinstance(a, int) and isinstance(b, int) and not isinstance(a, bool) and not isinstance(b, bool):
                continue
            if isinstance(a, list) and isinstance(b, list) and len(a) != len(b):
                _refuse_count(base, d, k, (names[0], name))
            raise InputError(f"{names[0]!r} and {name!r} differ in config field {k!r} ({a!r} vs {b!r}), which "
                             "changes what the model computes; expected models of one configuration (apart "
                             "from widths an alignment can bridge)")


def _refuse_count(a: dict, b: dict, key: str, names) -> None:
    """Configs whose list ``key`` has one entry per item of a count they differ in (``layer_types``
    and ``num_hidden_layers``): refused naming the count, as a user would."""
    n, m = len(a[key]), len(b[key])
    count = next((k for k, v in a.items() if v == n and b.get(k) == m and type(v) is int), None)
    what = f"config field {count!r} ({n} vs {m}; {key!r} has one entry each)" if count else \
        f"config field {key!r} ({n} vs {m} entries)"
    raise InputError(f"{names[0]!r} and {names[1]!r} differ in {what}; expected models of one depth (a merge "
                     "pairs their layers one to one)")


def config_diff(models, names) -> str:
    """``" (configs differ: num_hidden_layers 2 vs 3, ...)"`` or ``""``."""
    skip = METADATA
    cfgs = [c for c in (getattr(m, "config", None) for m in models) if c is not None]
    if len(cfgs) != len(models):
        return ""
    base = cfgs[0].to_dict()
    diffs = []
    for name, c in zip(names[1:], cfgs[1:]):
        d = c.to_dict()
        for k in sorted(set(base) | set(d)):
            if k not in skip and not same_value(base.get(k), d.get(k)) and not isinstance(base.get(k), (dict, list)):
                diffs.append(f"{k} {base.get(k)!r} vs {d.get(k)!r}")
    return f" (configs differ: {', '.join(diffs[:6])}{' ...' if len(diffs) > 6 else ''})" if diffs else ""


def width_change(configs, names, anchor: int = 0) -> list:
    """The sizes in which a model's config differs from the anchor's (``configs[anchor]``), as
    ``"'b': intermediate_size 64 -> 48"``: widths the alignment bridges by transport (the merge has
    the anchor's); empty when every model has the anchor's sizes."""
    if any(c is None for c in configs):
        return []
    base = configs[anchor].to_dict()
    out = []
    for name, c in zip(names, configs):
        d = c.to_dict()
        diffs = [f"{k} {d[k]} -> {base[k]}" for k in sorted(set(base) & set(d))
                 if k not in NOT_FUNCTION and type(base[k]) is int and type(d[k]) is int and base[k] != d[k]]
        if diffs:
            out.append(f"{name!r}: {', '.join(diffs)}")
    return out
