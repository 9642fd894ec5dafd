"""Loading checkpoints exactly or not at all.

Models are loaded with transformers' own machinery (``from_pretrained``: key renaming, tied
weights, sharded ``*.safetensors.index.json``, ``dtype="auto"`` so bf16 stays bf16), from
safetensors only (a pickle can run code). A checkpoint is refused, naming the tensors, when a
parameter of the built model was not in it, when one of its tensors was not used, when shapes
differ, or when a weight is NaN/inf. Hub ids are tried only when the hub can be reached:
offline (``HF_HUB_OFFLINE=1``) a name that is not in the local cache fails at once.
"""
from __future__ import annotations

import json
import os

import torch

from ..core.files import special_file
from ..errors import InputError

__all__ = ["check_checkpoint_dir", "load_local", "load_hub", "refuse_incomplete", "check_weights_finite"]

SAFETENSORS = ("model.safetensors", "model.safetensors.index.json")
PICKLES = ("pytorch_model.bin", "pytorch_model.bin.index.json")
EXPECTED = "a save_pretrained directory (config.json + model.safetensors)"


def _quiet_transformers():
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import transformers
    transformers.logging.set_verbosity_error()
    try:
        transformers.logging.disable_progress_bar()
    except AttributeError:  # pragma: no cover
        pass
    return transformers


def check_checkpoint_dir(path: str):
    """Refuse a missing path, a file, or a directory without a config or safetensors weights."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"model path {path!r} does not exist; expected {EXPECTED}")
    if not os.path.isdir(path):
        raise InputError(f"model path {path!r} is a file; expected {EXPECTED}")
    files = set(os.listdir(path))
    for f in sorted(files):  # what symgraph may open: never block on a FIFO or a device
        what = special_file(os.path.join(path, f)) if f.endswith((".json", ".safetensors", ".txt", ".model")) else None
        if what:
            raise InputError(f"{os.path.join(path, f)!r} is {what}, not a regular file; expected {EXPECTED} "
                             "of regular files")
    if SAFETENSORS[1] in files:
        read_index(os.path.join(path, SAFETENSORS[1]))
    has_weights = any(f in files for f in SAFETENSORS)
    if not has_weights and any(f in files for f in PICKLES):
        raise InputError(f"{path!r} holds only pytorch_model.bin, a pickle, which symgraph does not "
                         "load (unpickling can run code); expected model.safetensors (load the model "
                         "yourself once and save it with save_pretrained(dir, safe_serialization=True))")
    missing = [] if "config.json" in files else ["config.json"]
    if not has_weights:
        missing.append("model.safetensors")
    if missing:
        raise InputError(f"directory {path!r} has no {' and no '.join(missing)}; expected {EXPECTED}")


def read_index(index: str) -> dict:
    """The ``weight_map`` of a shard index ``model.safetensors.index.json``, refused in one
    line unless it is what ``save_pretrained`` writes (a ``metadata`` object and a
    ``weight_map`` of tensor name -> file name: transformers reads both)."""
    expected = ("expected the index save_pretrained writes ({'metadata': {...}, 'weight_map': {tensor: "
                "shard file}})")
    try:
        with open(index) as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise InputError(f"cannot read {index!r} ({e}); {expected}") from None
    if not isinstance(raw, dict):
        raise InputError(f"{index!r} holds a JSON {type(raw).__name__}; {expected}")
    wm = raw.get("weight_map")
    if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
        what = ("no 'weight_map'" if wm is None else f"a 'weight_map' that is a {type(wm).__name__}"
                if not isinstance(wm, dict) else "'weight_map' entries that are not tensor name -> file name")
        raise InputError(f"{index!r} has {what}; {expected}")
    if not isinstance(raw.get("metadata"), dict):
        raise InputError(f"{index!r} has no 'metadata' object; {expected}")
    return wm


def refuse_remote_code(path: str) -> None:
    """Refuse a checkpoint whose config asks for its own Python code (``auto_map``), before
    transformers reads it: no code from a model directory ever runs, and nothing prompts."""
    cfg_path = os.path.join(path, "config.json")
    try:
        with open(cfg_path) as f:
            raw = json.load(f)
    except (OSError, ValueError):
        return  # unreadable configs are refused by the loader with their own message
    auto = raw.get("auto_map") if isinstance(raw, dict) else None
    if auto:
        entry = next(iter(auto.items())) if isinstance(auto, dict) else auto
        raise InputError(f"{cfg_path} asks for the directory's own code (auto_map {entry!r}); symgraph never "
                         "runs code from a model directory; expected a model class that transformers ships")


def _model_class(tf, cfg, where):
    archs = getattr(cfg, "architectures", None) or []
    if not archs:
        raise InputError(f"{where} has no 'architectures' entry; expected the model class name "
                         "(e.g. [\"BertForMaskedLM\"]) as save_pretrained writes it")
    cls = getattr(tf, archs[0], None)
    if cls is None:
        raise InputError(f"config architecture {archs[0]!r} is not a transformers class; expected a "
                         "model class available in the installed transformers")
    return cls


def _names(keys, most=5):
    keys = sorted(keys)
    more = f" (+{len(keys) - most} more)" if len(keys) > most else ""
    return ", ".join(repr(k) for k in keys[:most]) + more


def refuse_incomplete(info: dict, where: str, cls_name: str):
    """Refuse a load whose ``output_loading_info`` shows any missing, unused or resized tensor."""
    missing = set(info.get("missing_keys") or ())
    unexpected = set(info.get("unexpected_keys") or ())
    mismatched = {k[0] if isinstance(k, tuple) else k for k in (info.get("mismatched_keys") or ())}
    errors = list(info.get("error_msgs") or ())
    parts = []
    if missing:
        parts.append(f"{len(missing)} parameter(s) of {cls_name} are not in the checkpoint ({_names(missing)}) "
                     "and would stay at random initialisation")
    if unexpected:
        parts.append(f"{len(unexpected)} checkpoint tensor(s) are not used by {cls_name} ({_names(unexpected)})")
    if mismatched:
        parts.append(f"{len(mismatched)} tensor(s) have other shapes than the config says ({_names(mismatched)})")
    if errors:
        parts.append("; ".join(str(e).splitlines()[0] for e in errors[:3]))
    if parts:
        raise InputError(f"refusing {where}: " + "; ".join(parts) + f"; expected a checkpoint holding "
                         f"exactly the weights of {cls_name} (saved with save_pretrained)")


def check_weights_finite(model, where: str):
    for name, p in model.named_parameters():
        if p.is_floating_point() and not torch.isfinite(p).all():
            bad = int((~torch.isfinite(p)).sum())
            raise InputError(f"checkpoint {where!r} has {bad} NaN/inf values in tensor {name!r}; "
                             "expected finite weights (was the model trained with a diverging loss?)")


def _from_pretrained(cls, source, where, **kw):
    try:
        model, info = cls.from_pretrained(source, dtype="auto", use_safetensors=True,
                                          output_loading_info=True, trust_remote_code=False, **kw)
    except (OSError, ValueError, RuntimeError, KeyError, EnvironmentError) as e:
        msg = " ".join(str(e).split())[:300] or type(e).__name__
        raise InputError(f"cannot load {where}: {msg}; expected {EXPECTED} with valid safetensors "
                         "weights") from None
    except Exception as e:  # noqa: BLE001 - safetensors' own errors (truncated, corrupt header)
        msg = " ".join(str(e).split())[:300] or type(e).__name__
        raise InputError(f"cannot read the weights of {where}: {msg}; expected valid safetensors "
                         "files written by save_pretrained") from None
    refuse_incomplete(info, where, cls.__name__)
    check_weights_finite(model, where)
    model.eval()
    return model


def load_local(path: str):
    """The model of a ``save_pretrained`` directory, loaded completely or refused."""
    check_checkpoint_dir(path)
    refuse_remote_code(path)
    tf = _quiet_transformers()
    cfg_path = os.path.join(path, "config.json")
    try:
        cfg = tf.AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as e:
        raise InputError(f"cannot read {cfg_path}: {' '.join(str(e).split())[:200]}; expected a "
                         "Hugging Face config written by save_pretrained") from None
    cls = _model_class(tf, cfg, cfg_path)
    return _from_pretrained(cls, path, repr(path), local_files_only=True)


def _offline() -> bool:
    try:
        from huggingface_hub import constants
        return bool(constants.HF_HUB_OFFLINE)
    except Exception:  # noqa: BLE001 - old huggingface_hub
        return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")


def load_hub(spec: str, hint: str = ""):
    """A hub id, loaded completely or refused; offline, only from the local cache (at once)."""
    tf = _quiet_transformers()
    offline = _offline()
    try:
        cfg = tf.AutoConfig.from_pretrained(spec, local_files_only=offline, trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 - offline, no such repo, ...
        msg = " ".join(str(e).split())[:200] or type(e).__name__
        where = "the local hub cache (offline: HF_HUB_OFFLINE is set)" if offline else "the Hugging Face hub"
        raise FileNotFoundError(f"{spec!r} is not a local path{hint} and could not be loaded from {where} "
                                f"({msg}); expected {EXPECTED}, or a reachable hub id with safetensors "
                                "weights") from None
    cls = _model_class(tf, cfg, f"the config of {spec!r}")
    return _from_pretrained(cls, spec, repr(spec), local_files_only=offline)
