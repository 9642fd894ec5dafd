"""Whether a row's eager failure is transformers' own (issue 65): the class on its family's own
default config, at full size, fails its forward the same way, so the shrink rule is not the
cause. Run for real, not on the meta device: a meta tensor takes no ``.item()`` (a mask's
packed-sequence test) and turns ``torch.tensor(None)`` into a 0-d tensor, so a meta run fails
elsewhere than the real one."""
from __future__ import annotations

import os
import traceback

#: the largest default model run here (parameters; float32: 1.2 GB), beside the row's tiny one
#: under the child's memory limit. A larger default proves nothing: its row stays ours.
MOST_PARAMETERS = 300_000_000


def where(e: BaseException) -> str:
    """``file:line`` of the frame that raised ``e`` (empty without a traceback)."""
    tb = traceback.extract_tb(e.__traceback__)
    return f"{os.path.basename(tb[-1].filename)}:{tb[-1].lineno}" if tb else ""


def fails_eager_at_default(model_type: str, class_name: str, most: int = MOST_PARAMETERS) -> str | None:
    """``"Type at file:line"`` of the exception with which ``class_name``, built on transformers'
    own default config of ``model_type`` (float32, eval, its own initialisation), fails its
    forward on the example inputs :func:`symgraph.passes.inputs.default_inputs` builds for it;
    None when it runs, when the config or the model cannot be built (a build failure is
    :func:`.shrink.fails_at_default`'s), when building the inputs fails, or when the default
    model has more than ``most`` parameters (counted on the meta device): nothing proven."""
    import torch
    import transformers
    from transformers import CONFIG_MAPPING

    from symgraph.passes.inputs import default_inputs

    from .shrink import default_config, own_config
    try:
        cls = getattr(transformers, class_name)
        cfg = own_config(cls, default_config(CONFIG_MAPPING[model_type])[0])
        with torch.device("meta"):
            size = sum(p.numel() for p in cls(cfg).parameters())
        if size > most:
            return None
        torch.manual_seed(0)
        model = cls(cfg).float().eval()
        args, kwargs = default_inputs(model)
    except Exception:  # noqa: BLE001 - no forward to compare with
        return None
    try:
        with torch.no_grad():
            model(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - transformers' own forward failing is the answer
        return f"{type(e).__name__} at {where(e)}"
    return None
