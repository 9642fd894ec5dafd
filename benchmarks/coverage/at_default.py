"""Whether a row's eager failure is transformers' own (issue 65): the class on its family's own
default config, at full size, fails its forward the same way, so the shrink rule is not the
cause. Run for real where the default model fits beside the row's; a larger one (Llama 4's
108 B parameters) under fake tensors (shapes without data: transformers then skips its checks
that read values, as it does under ``torch.export``). Never on the meta device: a meta tensor
takes no ``.item()`` (a mask's packed-sequence test) and turns ``torch.tensor(None)`` into a
0-d tensor, so a meta run fails elsewhere than the real one."""
from __future__ import annotations

import os
import traceback

#: the largest default model run for real (parameters; float32: 1.2 GB), beside the row's tiny
#: one under the child's memory limit; a larger one runs under fake tensors
MOST_PARAMETERS = 300_000_000


def where(e: BaseException) -> str:
    """``file:line`` of the frame that raised ``e`` (empty without a traceback)."""
    tb = traceback.extract_tb(e.__traceback__)
    return f"{os.path.basename(tb[-1].filename)}:{tb[-1].lineno}" if tb else ""


def _model_frame(e: BaseException):
    """The innermost frame of ``e`` in transformers' own code, else the frame that raised it."""
    import transformers
    root = os.path.dirname(transformers.__file__) + os.sep
    tb = traceback.extract_tb(e.__traceback__)
    own = [f for f in tb if f.filename.startswith(root)]
    return (own or tb or [None])[-1]


def model_line(e: BaseException) -> str:
    """``file:line`` of the innermost frame of ``e`` in transformers' own code (the model's line
    that failed: the same under fake tensors, whose kernels raise from elsewhere in torch),
    else of the frame that raised it."""
    f = _model_frame(e)
    return f"{os.path.basename(f.filename)}:{f.lineno}" if f is not None else ""


def refusal(e: BaseException) -> bool:
    """Whether transformers raised ``e`` itself, on purpose (its line is a ``raise``: a check of
    the forward's arguments, such as Gemma 4's assistant refusing to run without the target's
    states). Such a failure is never cleared by the default config: our inputs may be what the
    check refuses at every size."""
    f = _model_frame(e)
    return f is not None and (f.line or "").lstrip().startswith("raise")


def fails_eager_at_default(model_type: str, class_name: str, most: int = MOST_PARAMETERS) -> str | None:
    """``"Type at file:line"`` (:func:`model_line`) of the exception with which ``class_name``, built on transformers'
    own default config of ``model_type`` (eval, its own initialisation), fails its
    forward on the example inputs :func:`symgraph.passes.inputs.default_inputs` builds for it;
    for real when the default model has at most ``most`` parameters (counted on the meta
    device), else under fake tensors. None when it runs, or when the config, the model or its
    inputs cannot be built (a build failure is :func:`.shrink.fails_at_default`'s)."""
    import contextlib

    import torch
    import transformers
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import CONFIG_MAPPING

    from symgraph.passes.inputs import default_inputs

    from .shrink import default_config, own_config
    try:
        cls = getattr(transformers, class_name)
        cfg = own_config(cls, default_config(CONFIG_MAPPING[model_type])[0])
        with torch.device("meta"):
            size = sum(p.numel() for p in cls(cfg).parameters())
    except Exception:  # noqa: BLE001 - no forward to compare with
        return None
    with contextlib.nullcontext() if size <= most else FakeTensorMode(allow_non_fake_inputs=True):
        try:
            torch.manual_seed(0)
            model = cls(cfg).eval()  # float32, torch's default (a fake one takes no .float())
            args, kwargs = default_inputs(model)
        except Exception:  # noqa: BLE001 - no forward to compare with
            return None
        try:
            with torch.no_grad():
                model(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - transformers' own forward failing is the answer
            return f"{type(e).__name__} at {model_line(e)}"
    return None
