"""mergekit configs read as symgraph's (``merge_method: linear``, ``models: [{model: ...,
parameters: {weight: ...}}]``): :func:`from_mergekit`. symgraph aligns first, so methods that
combine task vectors against a shared base model are refused with the reason."""
from __future__ import annotations

from ..core.progress import note
from ..core.schema import short_repr
from ..errors import InputError
from ..merging.methods.registry import names as merge_methods

__all__ = ["from_mergekit", "short_repr"]


#: mergekit methods that combine task vectors against a shared base model.
_NEEDS_BASE = {"task_arithmetic", "ties", "dare_ties", "dare_linear", "breadcrumbs", "breadcrumbs_ties",
               "della", "della_linear", "model_stock", "sce", "nearswap"}


def from_mergekit(cfg: dict, path: str) -> dict:
    """symgraph's options from a mergekit config (``merge_method``, ``models: [{model:,
    parameters: {weight:}}]``, ``parameters: {normalize:, ...}``, ``dtype``; the top-level
    ``parameters`` besides ``normalize`` are the method's own, as in mergekit): ``linear`` is
    symgraph's ``average`` (after alignment: symgraph aligns first, unless ``align: none``);
    methods that need a ``base_model`` are refused with the reason; other keys by name."""
    cfg = dict(cfg)
    where = f"mergekit config {path!r}"
    if "slices" in cfg:  # layer ranges stitched from several models: no merge of aligned whole models
        raise InputError(f"{where} has 'slices' (layer ranges of models), which symgraph does not take; expected "
                         "'models:' listing whole models to align and merge")
    cfg["method"] = _method(cfg, where)
    cfg.pop("base_model", None)
    dtype = cfg.pop("dtype", None)
    if dtype is not None:  # mergekit's compute dtype: symgraph computes in float32 (or wider) anyway
        if not isinstance(dtype, str) or dtype not in ("float32", "float16", "bfloat16", "float64"):
            raise InputError(f"{where}: dtype {short_repr(dtype)}; expected float32, float16 or bfloat16 (mergekit's "
                             "compute dtype)")
        note(f"dtype {dtype} in {where}: symgraph computes in float32 (float64 for float64 models) and "
             "writes each tensor in the first model's dtype")
    top = _top_parameters(cfg.pop("parameters", None) or {}, where)
    if top:  # the method's own (RegMean's alpha, Fisher's eps), checked by its declaration
        cfg["parameters"] = top
    models, weights = _models(cfg.get("models") or [], where)
    if any(w is None for w in weights) and any(w is not None for w in weights):
        raise InputError(f"{where}: some models have a weight and others not; expected a weight for each or none")
    cfg["models"] = models
    if weights and weights[0] is not None:
        cfg["weights"] = weights
    return cfg


def _method(cfg: dict, where: str) -> str:
    """symgraph's method for ``cfg``'s ``merge_method`` (popped), or refused in one line."""
    method = cfg.pop("merge_method", "linear")
    if not isinstance(method, str):
        raise InputError(f"{where}: merge_method is {short_repr(method)} ({type(method).__name__}); expected a method "
                         "name: linear (symgraph's average)")
    if method in _NEEDS_BASE or cfg.get("base_model") is not None:
        raise InputError(f"{where}: merge_method {method!r}{' with a base_model' if cfg.get('base_model') else ''} "
                         "combines task vectors against a shared base model, and symgraph merges models that "
                         "share no base (it aligns them first); expected merge_method linear (symgraph's average), "
                         "or align with symgraph and merge with mergekit")
    if method != "linear" and method not in merge_methods():
        raise InputError(f"{where}: merge_method {method!r} has no symgraph counterpart; expected linear "
                         f"(symgraph's average) or one of {merge_methods()}")
    return "average" if method == "linear" else method


def _top_parameters(top, where: str) -> dict:
    """The top-level ``parameters`` less ``normalize`` (which must be true): the method's own."""
    if not isinstance(top, dict):
        raise InputError(f"{where}: parameters is {short_repr(top)} ({type(top).__name__}); expected a mapping "
                         "{normalize: true} or no key")
    top = dict(top)
    if top.pop("normalize", True) is not True:
        raise InputError(f"{where}: parameters.normalize false; symgraph always normalises the weights to sum "
                         "to 1; expected normalize: true or no key")
    return top


def _models(entries, where: str) -> tuple[list, list]:
    """The model paths and their weights (None where not given) of the config's ``models``."""
    models, weights = [], []
    for i, m in enumerate(entries):
        if not isinstance(m, dict) or not isinstance(m.get("model"), str):
            raise InputError(f"{where}: models[{i}] is {short_repr(m)}; expected {{model: path, parameters: "
                             "{weight: w}}")
        extra = sorted(map(str, set(m) - {"model", "parameters"}))
        params = m.get("parameters") or {}
        if not isinstance(params, dict):
            raise InputError(f"{where}: models[{i}].parameters is {short_repr(params)} ({type(params).__name__}); "
                             "expected a mapping {weight: w}")
        params = dict(params)
        w = params.pop("weight", None)
        if extra or params:
            raise InputError(f"{where}: models[{i}] has {extra + sorted(map(str, params))}; expected only model and "
                             "parameters.weight")
        models.append(m["model"])
        weights.append(w)
    return models, weights
