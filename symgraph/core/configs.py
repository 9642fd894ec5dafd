"""What the configs of models to be merged or aligned differ in: their classes, and the fields
a refusal found late (two graphs that differ) names, so that it says what a user changed."""
from __future__ import annotations

from ..errors import InputError
from .finite import same_value

__all__ = ["METADATA", "ConfigsDiffer", "check_same_family", "config_diff", "with_config_diff"]

#: Config fields that do not change what a model computes in evaluation.
METADATA = {"_name_or_path", "architectures", "transformers_version", "dtype", "torch_dtype", "_commit_hash"}


class ConfigsDiffer(InputError):
    """The refusal of :func:`check_same_configs`: it names the field the configs differ in."""


def check_same_family(models, names, error: type = InputError):
    """Refuse models of different classes before any work, naming them (``error``: the refusal's
    class; :func:`symgraph.align` raises a ``StructureMismatchError``)."""
    classes = [type(m).__name__ for m in models]
    for name, cls in zip(names[1:], classes[1:]):
        if cls != classes[0]:
            raise error(f"{names[0]!r} is a {classes[0]} but {name!r} is a {cls}; expected models of "
                             "one architecture")


def with_config_diff(e: Exception, models, names) -> Exception:
    """``e`` (a refusal of ``models``, named ``names``) again, its message followed by how their
    configs differ (:func:`config_diff`); as it is where it names the field already."""
    if isinstance(e, ConfigsDiffer) or " (configs differ: " in str(e):  # named already, or said once
        return e
    return type(e)(f"{e}{config_diff(models, names)}")


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
