"""Sizes of a detector's config that the shrink rule derives from its backbone's (issue 65): the
detector reads its backbone's feature maps, so what it states about them follows what the
shrunk backbone makes. Each rule reads what the config states (a field's name and default,
the backbone's image and patch sizes), never a family's name."""
from __future__ import annotations

from .tower_sizes import is_int


def _int_lists(d) -> dict:
    """The backbone's lists of channels per stage (``stage_out_channels``, ``hidden_sizes``)."""
    return {k: list(v) for k, v in d.items() if isinstance(v, (list, tuple)) and v and all(is_int(x) for x in v)
            and ("channels" in k.split("_") and "out" in k.split("_") or k == "hidden_sizes")}


def backbone_rules(fields, out) -> dict:
    """:func:`feature_widths` and :func:`object_queries` of one level (one dict of overrides)."""
    return {**feature_widths(fields, out), **object_queries(fields, out)}


def feature_widths(fields, out) -> dict:
    """A width named for a feature map (``feat``) that the shrink rule changed and whose default
    is the output channels of one of the backbone's stages (PP-DocLayout V3's ``x4_feat_dim``
    128: its HGNet-V2 backbone's first stage, read by the mask head) is that stage's channels
    in the shrunk backbone (a backbone the rule leaves at its widths keeps 128)."""
    old_bb, new_bb = fields.get("backbone_config"), out.get("backbone_config")
    if not (hasattr(old_bb, "to_dict") and isinstance(new_bb, dict)):
        return {}
    old, new = _int_lists(vars(old_bb)), _int_lists(new_bb)
    res = {}
    for k, v in out.items():
        d = fields.get(k)
        if "feat" not in k.split("_") or not (is_int(v) and is_int(d)) or v == d:
            continue
        found = {new[name][old[name].index(d)] for name in old
                 if d in old[name] and len(new.get(name, ())) == len(old[name])}
        if len(found) == 1:
            res[k] = found.pop()
    return res


def object_queries(fields, out) -> dict:
    """``num_queries`` no more than the patches of the backbone's shrunk image (a two-stage
    detector takes its queries as the top ``num_queries`` of one proposal a patch: RF-DETR's 300
    of the 4 × 4 patches of a 64-pixel image in 14-pixel patches cannot be taken)."""
    q, bb = fields.get("num_queries"), out.get("backbone_config")
    image, patch = (bb.get("image_size"), bb.get("patch_size")) if isinstance(bb, dict) else (None, None)
    if not (is_int(q) and is_int(image) and is_int(patch) and patch > 0 and image >= patch):
        return {}
    most = (image // patch) ** 2
    return {"num_queries": most} if q > most else {}
