"""Whether a row's failure is transformers' own: the class on its family's own default config
fails the same way, so the shrink rule is not the cause. A forward runs for real where the
default model fits beside the row's, a larger one (Llama 4's 108 B parameters) under fake tensors
(shapes without data; transformers then skips its checks that read values). Never on the meta
device: a meta tensor takes no ``.item()``, so a meta run fails elsewhere than the real one."""
from __future__ import annotations

import os
import traceback

#: the largest default model run for real (parameters; float32: 1.2 GB)
MOST_PARAMETERS = 300_000_000


def _line(frame) -> str:
    return f"{os.path.basename(frame.filename)}:{frame.lineno}" if frame is not None else ""


def where(e: BaseException) -> str:
    """``file:line`` of the frame that raised ``e`` (empty without a traceback)."""
    return _line((traceback.extract_tb(e.__traceback__) or [None])[-1])


def _model_frame(e: BaseException):
    """The innermost frame of ``e`` in transformers' own code, else the frame that raised it."""
    import transformers
    root = os.path.dirname(transformers.__file__) + os.sep
    tb = traceback.extract_tb(e.__traceback__)
    return ([f for f in tb if f.filename.startswith(root)] or tb or [None])[-1]


def model_line(e: BaseException) -> str:
    """``file:line`` of :func:`_model_frame` (the model's line that failed: the same under fake
    tensors, whose kernels raise from elsewhere in torch)."""
    return _line(_model_frame(e))


def refusal(e: BaseException) -> bool:
    """Whether transformers raised ``e`` on purpose (its line is a ``raise``: a check of the
    forward's arguments, Gemma 4's assistant refusing to run without the target's states). The
    default config never clears it: our inputs may be what it refuses at every size."""
    f = _model_frame(e)
    return f is not None and (f.line or "").lstrip().startswith("raise")


def _default(model_type: str, class_name: str):
    """``(class, config)``: ``class_name`` and the config transformers' default config of
    ``model_type`` builds it on."""
    import transformers
    from transformers import CONFIG_MAPPING

    from .shrink import default_config, own_config
    cls = getattr(transformers, class_name)
    return cls, own_config(cls, default_config(CONFIG_MAPPING[model_type])[0])


def fails_at_default(model_type: str, class_name: str) -> str | None:
    """``"Type: message"`` of the exception with which transformers' own default config of the
    family fails to validate, or ``class_name`` fails to be constructed on it (on the meta
    device); None when both succeed."""
    import torch
    try:
        cls, cfg = _default(model_type, class_name)
        with torch.device("meta"):
            cls(cfg)
    except Exception as e:  # noqa: BLE001 - any failure of transformers' own is the answer
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"
    return None


def fails_eager_at_default(model_type: str, class_name: str, most: int = MOST_PARAMETERS) -> str | None:
    """``"Type at file:line"`` (:func:`model_line`) of the exception with which ``class_name`` on
    its default config (eval, its own initialisation) fails its forward on the example inputs of
    :func:`symgraph.passes.inputs.default_inputs`: for real when the model has at most ``most``
    parameters (counted on the meta device), else under fake tensors. None when it runs, or when
    the model or its inputs cannot be built (that is :func:`fails_at_default`'s)."""
    import contextlib

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from symgraph.passes.inputs import default_inputs
    try:
        cls, cfg = _default(model_type, class_name)
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
