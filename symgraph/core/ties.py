"""Tied parameters (one tensor under several names: GPT-2's head and embedding, shared layers):
kept tied where PyTorch would split them (``Module.to`` on a device whose tensors cannot be
shallow-copied into the CPU parameter gives each name its own copy, and
``load_state_dict(assign=True)`` assigns each name its own tensor), and untied where asked.

Untying (Theus et al. 2025 clone GPT-2's ``lm_head`` before folding the final norm): with its
own head, the residual stream no longer has to map the vocabulary embedding and the output
projection by one shared element, so it admits its orthogonal maps; the model then stores one
more ``vocabulary × width`` matrix. A tied model and its untied form (``symgraph rotate``'s
output, a merge with ``--untie``) compute one function, so a pair of them is compared,
aligned or merged through the tied one untied (:func:`side_to_untie`)."""
from __future__ import annotations

import copy

import torch

from ..errors import InputError

__all__ = ["parameter_names", "tied_groups", "retie", "to_device", "untie", "untie_config_updates", "side_to_untie",
           "untied_to_match", "tie_refusal", "check_ties", "check_untie"]


def parameter_names(model: torch.nn.Module) -> dict:
    """``{parameter: the names it goes by}`` of ``model`` (tied weights share one; the first
    name in module order is the parameter's)."""
    by_id: dict = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return {names[0]: names for names in by_id.values()}


def tied_groups(model: torch.nn.Module) -> list:
    """Groups of parameter names that share one tensor (each of two or more names)."""
    return [names for names in parameter_names(model).values() if len(names) > 1]


def retie(model: torch.nn.Module, groups) -> None:
    """Point every name of each group of ``groups`` at the first name's parameter."""
    for names in groups:
        first = model.get_parameter(names[0])
        for name in names[1:]:
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr, first)


def to_device(model: torch.nn.Module, device) -> torch.nn.Module:
    """``model.to(device)`` with its tied parameters still tied."""
    groups = tied_groups(model)
    model = model.to(device)
    retie(model, groups)
    return model


def untie(model):
    """A copy of ``model`` whose tied parameters are separate tensors (the first name of each
    tied group keeps the original; every other name gets a copy), with a config that says
    so (``tie_word_embeddings=False``), so that ``save_pretrained`` / ``from_pretrained`` keep
    them apart. ``model`` is left untouched."""
    out = copy.deepcopy(model)
    for names in tied_groups(out):
        for name in names[1:]:
            parent, _, attr = name.rpartition(".")
            mod = out.get_submodule(parent) if parent else out
            setattr(mod, attr, torch.nn.Parameter(getattr(mod, attr).detach().clone(),
                                                  requires_grad=getattr(mod, attr).requires_grad))
    cfg = getattr(out, "config", None)
    for c in {id(x): x for x in (cfg, getattr(cfg, "get_text_config", lambda: None)())}.values():
        if c is not None and getattr(c, "tie_word_embeddings", False):
            c.tie_word_embeddings = False
    return out


def untie_config_updates(config) -> dict:
    """The ``config.json`` fields :func:`untie` changes in ``config``: ``tie_word_embeddings``
    false where it is set, at the top and in a nested text config (``{"text_config":
    {"tie_word_embeddings": False}}``, a field of that nested config); none for ``None``."""
    out: dict = {}
    if config is None:
        return out
    if getattr(config, "tie_word_embeddings", False):
        out["tie_word_embeddings"] = False
    text = getattr(config, "get_text_config", lambda: None)()
    if text is not None and text is not config and getattr(text, "tie_word_embeddings", False):
        field = next((k for k, v in vars(config).items() if v is text), None)
        if field is not None:
            out[field] = {"tie_word_embeddings": False}
    return out


def side_to_untie(names_a: dict, names_b: dict) -> int | None:
    """Which of two models of one architecture ties what the other stores apart: 0 or 1, the
    one to :func:`untie` so that both have the same parameters (``names_*``: ``{parameter: the
    names it goes by}``, :func:`parameter_names`; a tied model and its untied form); None where
    neither does. It is the one for which every parameter the other has and it lacks is
    another name of one of its tied parameters."""
    for i, (x, y) in enumerate(((names_a, names_b), (names_b, names_a))):
        extra = set(y) - set(x)
        if extra and extra <= {n for names in x.values() for n in names[1:]}:
            return i
    return None


def tie_refusal(tied: str, loose: str, why: str = "") -> InputError:
    """The one-line refusal of a tied model (``tied``: its name) beside its untied form
    (``loose``) in a job that does not untie; ``why``: what shows it (a config field)."""
    return InputError(f"{tied} ties its output head to its input embedding and {loose} stores them apart{why}; "
                      "expected models of one configuration, or --untie (untie=True) to give the tied model its "
                      "own head first")


def check_untie(models, labels=None) -> None:
    """Refuse untying (``--untie``, ``untie=True``) models none of which ties parameters: the
    option would change nothing, and a merge must not say it untied what it did not."""
    if not any(tied_groups(m) for m in models):
        labels = labels or [f"model {i}" for i in range(len(models))]
        raise InputError(f"--untie (untie=True) given, but no model ties parameters ({', '.join(map(str, labels))} "
                         "store every tensor apart): nothing to untie; expected models with a tied head "
                         "(tie_word_embeddings), or no --untie")


def check_ties(models, labels=None) -> None:
    """Refuse models of which one ties parameters another stores apart (:func:`side_to_untie`),
    naming them (``labels``, default "model 0", "model 1", ...)."""
    labels = labels or [f"model {i}" for i in range(len(models))]
    names = [parameter_names(m) for m in models]
    for i in range(1, len(models)):
        side = side_to_untie(names[0], names[i])
        if side is not None:
            pair = (labels[0], labels[i])
            raise tie_refusal(pair[side], pair[1 - side])


def untied_to_match(a, b) -> tuple:
    """``(a, b, untied)``: the two models, the one that ties parameters the other stores apart
    (:func:`side_to_untie`: a model and its untied form, ``symgraph rotate``'s output)
    replaced by its untied form (:func:`untie` of a model; a checkpoint's ``untied()``, which
    reads the tied tensor under each name); ``untied``: ``{"A" or "B": the names it tied}``
    (empty where neither was)."""
    stored = [hasattr(m, "untied") and hasattr(m, "params") for m in (a, b)]
    if not (all(stored) or all(isinstance(m, torch.nn.Module) for m in (a, b))):
        return a, b, {}  # refused by the caller's checks
    names = [m.params if s else parameter_names(m) for m, s in zip((a, b), stored)]
    side = side_to_untie(*names)
    if side is None:
        return a, b, {}
    m = (a, b)[side]
    m = m.untied() if stored[side] else untie(m)
    a, b = (m, b) if side == 0 else (a, m)
    return a, b, {"AB"[side]: sorted(n for ns in names[side].values() for n in ns[1:])}
