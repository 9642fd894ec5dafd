"""The rules between a merge's options, which no one field's type can say ("repair needs
data", "sketch sketches weight matching", "circuits merge by averaging", ...): :func:`check`,
the validator of :class:`~symgraph.app.config.MergeConfig`, so every way of building a
config (the command line, a YAML file, :func:`symgraph.merge_checkpoints`, Python) is held to
them, each refusal one line naming the options as they were given."""
from __future__ import annotations

from ..alignment.options import AlignOptions
from ..core.schema import error_key, expected, refusal, short_repr
from ..errors import InputError
from ..merging.methods.registry import get as get_method, mixing_weights

__all__ = ["check", "refused"]


def check(opts: dict, name, batches: bool = False) -> None:
    """The checks between options, on values the schema accepted (each option's type and range
    are the schema's job: :class:`~symgraph.app.config.MergeConfig`, whose alignment fields
    :class:`AlignOptions` declares): the config's validator; ``name(key)`` says where an option came from in
    a refusal (``--refine``, or ``'refine:' in merge.yaml``); ``batches``: the data come as
    batches already loaded, not as ``data``."""
    n = name
    data = f"{n('data')} FILE" if n("data").startswith("--") else n("data")
    opts = {**opts, "data": opts["data"] or batches}
    if opts["refine"] and not opts["data"]:
        raise InputError(f"{n('refine')} needs {data} (batches for activation matching and the loss)")
    if opts["refine"] and opts["align"] in ("none", None):
        raise InputError(f"{n('refine')} needs an alignment to refine; expected {n('align')} activations")
    if opts["weights"] is not None:
        mixing_weights(opts["weights"], len(opts["models"]))
    if opts["attention"] == "circuits" and (opts["method"] != "average" or opts["repair"]):
        raise InputError(f"{n('attention')} circuits merges by averaging; expected {n('method')} average without "
                         f"{n('repair')}")
    if opts["sketch"] and opts["align"] != "weights":
        raise InputError(f"{n('sketch')} sketches weight matching; expected {n('align')} weights")
    if opts["tol"] and opts["align"] != "weights":
        raise InputError(f"{n('tol')} ends the sweeps of weight matching; expected {n('align')} weights")
    for key in ("max_iter", "until"):
        if opts[key] != AlignOptions.model_fields[key].default and opts["align"] in ("none", None):
            raise InputError(f"{n(key)} ends the sweeps of an alignment; expected {n('align')} weights or "
                             "activations")
    if opts["seen_rows"] and not opts["data"]:
        raise InputError(f"{n('seen_rows')} reads the embedding rows of the tokens in the data; expected {data}")
    if opts["seen_rows"] and opts["align"] != "weights":
        raise InputError(f"{n('seen_rows')} restricts weight matching; expected {n('align')} weights")
    if opts["full_groups"] and opts["align"] in ("none", None):
        raise InputError(f"{n('full_groups')} fits the groups an alignment solves; expected {n('align')} weights "
                         "or activations")
    anchor, count = opts["anchor"], len(opts["models"])
    if anchor == "universe" and (opts["align"] in ("none", None) or opts["attention"] == "circuits"):
        raise InputError(f"{n('anchor')} universe aligns every model to the mean of the others; expected "
                         f"{n('align')} weights or activations, with {n('attention')} heads")
    if anchor != "universe" and not 0 <= anchor < count:
        raise InputError(f"{n('anchor')} {anchor} is not one of the {count} models; expected an index 0..{count - 1} "
                         "or universe")
    if opts["repair"] and not opts["data"]:
        raise InputError(f"{n('repair')} needs {data} (batches to measure activation statistics on)")
    needs_data = get_method(opts["method"]).needs_data or opts["align"] == "activations"
    if needs_data and not opts["data"]:
        raise InputError(f"{n('align')} {opts['align']} with {n('method')} {opts['method']} needs {data} (a "
                         ".safetensors or .pt file with a tensor 'input_ids' [N, S]); expected it, or "
                         f"{n('align')} weights/none with {n('method')} average")


def refused(e, given: dict, name, schema) -> str:
    """One line for the first error of a config's validation (``e``, pydantic's, of ``schema``):
    a field's names it and the value ``given`` (``name(key)``: a flag, or where a YAML file set
    it); a rule between fields (:func:`check`) says it all."""
    err = e.errors()[0]
    if not err.get("loc"):  # the model's validator: check()'s own line
        return str(err.get("msg", "")).removeprefix("Value error, ")
    key = error_key(err)
    if key not in schema.model_fields:
        return f"{key!r} is not a merge option; expected only {', '.join(schema.model_fields)}"
    return refusal(err, f"{name(key)} {short_repr(given.get(key))}", expected(schema, key))
