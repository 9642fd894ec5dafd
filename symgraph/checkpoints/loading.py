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

from ..core.devices import meta_model
from ..core.dtypes import SAFETENSORS_DTYPES
from ..core.finite import check_config_numbers, class_defaults
from ..core.files import PinnedFile, model_file
from ..core.schema import quoted
from ..core.ties import parameter_names
from ..errors import InputError
from .layout import Layout

__all__ = ["check_checkpoint_dir", "read_layout", "read_config", "build_meta", "Layout", "load_local", "load_hub",
           "refuse_incomplete", "check_weights_finite", "quiet_transformers"]

SAFETENSORS = ("model.safetensors", "model.safetensors.index.json")
PICKLES = ("pytorch_model.bin", "pytorch_model.bin.index.json")
EXPECTED = "a save_pretrained directory (config.json + model.safetensors)"


def quiet_transformers():
    """transformers imported with its logging at errors only and no progress bars."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import transformers
    transformers.logging.set_verbosity_error()
    try:
        transformers.logging.disable_progress_bar()
    except AttributeError:  # pragma: no cover
        pass
    return transformers


#: Suffixes of the files symgraph or transformers may read from a model directory (configs,
#: weights, tokenizer and generation files): each must be a regular file inside it.
READ_SUFFIXES = (".json", ".safetensors", ".txt", ".model", ".jinja")


def check_checkpoint_dir(path: str):
    """Refuse a missing path, a file, a directory without a config or safetensors weights, and
    one whose files (or the shards its index names) are not regular files inside it."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"model path {path!r} does not exist; expected {EXPECTED}")
    if not os.path.isdir(path):
        raise InputError(f"model path {path!r} is a file; expected {EXPECTED}")
    files = set(os.listdir(path))
    for f in sorted(files):  # what symgraph may open: never a FIFO, a device or a file elsewhere
        if f.endswith(READ_SUFFIXES):
            model_file(path, f)
    if SAFETENSORS[1] in files:
        if SAFETENSORS[0] in files:
            raise InputError(f"{path!r} holds both {SAFETENSORS[0]} and a shard index {SAFETENSORS[1]}, so "
                             "which weights are the model's is ambiguous; expected one of them (move the other "
                             "out of the directory)")
        for shard in sorted(set(read_index(os.path.join(path, SAFETENSORS[1])).values())):
            model_file(path, shard, what=f"shard named by {SAFETENSORS[1]}")
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


#: safetensors dtype names symgraph reads, and their torch dtypes.
DTYPES = SAFETENSORS_DTYPES


def read_layout(path: str) -> Layout:
    """The :class:`Layout` of a checked checkpoint directory, refused in one line unless the
    index and the shards agree exactly: every tensor in exactly one shard, every shard tensor in
    the index at that shard, every dtype one symgraph reads."""
    from safetensors import safe_open
    index = os.path.join(path, SAFETENSORS[1])
    if os.path.isfile(index):
        weight_map = read_index(index)
        real = {f: model_file(path, f, what=f"shard named by {SAFETENSORS[1]}") for f in set(weight_map.values())}
        shards = sorted(real)
    else:
        weight_map, real, shards = None, {SAFETENSORS[0]: model_file(path, SAFETENSORS[0])}, [SAFETENSORS[0]]
    where: dict = {}
    shapes: dict = {}
    dtypes: dict = {}
    pins: dict = {}
    for name in shards:
        try:
            pins[real[name]] = pin = PinnedFile(real[name])  # opened once for the run, every read checked
            with safe_open(pin.reader, framework="pt", device="cpu") as h:
                for key in h.keys():
                    if key in where:
                        raise InputError(f"{path!r}: tensor {key!r} is in two shards ({where[key]} and {name}); "
                                         "expected every tensor in exactly one shard")
                    if weight_map is not None and weight_map.get(key) != name:
                        listed = (f"the index puts it in {weight_map[key]}" if key in weight_map
                                  else "the index does not list it")
                        raise InputError(f"{path!r}: shard {name} holds tensor {key!r}, but {listed}; expected "
                                         f"shards that agree with {SAFETENSORS[1]}")
                    sl = h.get_slice(key)
                    kind = sl.get_dtype()
                    if kind not in DTYPES:
                        raise InputError(f"{path!r}: tensor {key!r} is stored as {kind}, which symgraph does not "
                                         f"merge; expected {', '.join(DTYPES)} tensors (dequantise the model first)")
                    where[key], shapes[key], dtypes[key] = name, tuple(sl.get_shape()), DTYPES[kind]
        except InputError:
            raise
        except Exception as e:  # noqa: BLE001 - safetensors' own errors (truncated, corrupt header)
            raise InputError(f"cannot read the weights of {path!r} ({name}): {quoted(e)}; "
                             "expected valid safetensors files written by save_pretrained") from None
    absent = sorted(set(weight_map or ()) - set(where))
    if absent:
        raise InputError(f"{path!r}: tensor(s) {_names(absent)} are in the index but not in their shard; "
                         "expected a complete checkpoint")
    keys = list(weight_map) if weight_map is not None else list(where)
    return Layout({k: real[where[k]] for k in keys}, shapes, dtypes, keys, pins)


def read_config(path: str):
    """The transformers config of a checked checkpoint directory and its model class, refused in
    one line when transformers cannot read it (a field of the wrong type or value) or when it
    names no model class transformers ships."""
    refuse_remote_code(path)
    tf = quiet_transformers()
    cfg_path = os.path.join(path, "config.json")
    try:
        cfg = tf.AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 - a missing or mistyped field (huggingface_hub's strict dataclasses)
        raise InputError(f"cannot read {cfg_path}: {quoted(e)}; expected a "
                         "Hugging Face config written by save_pretrained") from None
    check_config_numbers(cfg.to_dict(), cfg_path, class_defaults(cfg))  # a NaN or negative epsilon: NaN computed
    return cfg, _model_class(tf, cfg, cfg_path)


def build_meta(cls, config, layout: Layout, where: str):
    """``cls(config)`` on the ``meta`` device in the checkpoint's dtype (no weights), refused in one
    line when the config cannot build the model, or would build far more modules than the
    checkpoint has tensors (an absurd layer count would otherwise run for hours)."""
    limit = 64 * len(layout.keys) + 4096
    count = [0]
    init = torch.nn.Module.__init__

    def counted(self, *a, **k):
        count[0] += 1
        if count[0] > limit:
            raise _TooManyModules
        init(self, *a, **k)
    torch.nn.Module.__init__ = counted  # type: ignore[method-assign]  # deliberate: counts modules while building
    try:
        return meta_model(cls, config).to(layout.dtype).eval()  # every parameter, a legacy constructor's too
    except _TooManyModules:
        raise InputError(f"{where} builds more than {limit} modules for a checkpoint of {len(layout.keys)} "
                         "tensors; expected a config whose sizes match its weights") from None
    except (InputError, MemoryError):
        raise
    except Exception as e:  # noqa: BLE001 - a config field of the wrong type or value, an attention backend
        raise InputError(f"{where} cannot build {cls.__name__} ({type(e).__name__}: {quoted(e)}); "
                         "expected a config whose fields have the types and values transformers accepts") from None
    finally:
        torch.nn.Module.__init__ = init  # type: ignore[method-assign]  # put back


class _TooManyModules(Exception):
    pass


class KeysDiffer(InputError):
    """The checkpoint's tensor names are not the built model's (transformers renames or
    converts them on load, e.g. fused MoE experts): it can only be merged after
    ``from_pretrained``."""


def check_tensors(model, layout: Layout, path: str) -> dict:
    """Refuse (naming the tensors) a checkpoint without some parameter of ``model`` (built on
    ``meta``), with tensors the model does not use, or with shapes other than the config's:
    before reading any value. Returns ``{parameter: the names it goes by}`` (tied weights
    share one)."""
    params = parameter_names(model)
    sd = model.state_dict()
    unused = sorted(set(layout.shapes) - set(sd))
    missing = sorted(names[0] for names in params.values() if not any(a in layout.shapes for a in names))
    cls = type(model).__name__
    if unused or missing:
        parts = []
        if missing:
            parts.append(f"{len(missing)} parameter(s) of {cls} are not in the checkpoint ({_names(missing)})")
        if unused:
            parts.append(f"{len(unused)} checkpoint tensor(s) are not {cls}'s ({_names(unused)})")
        raise KeysDiffer(f"refusing {path!r}: " + "; ".join(parts) + f"; expected {EXPECTED} "
                         f"holding exactly the tensors of {cls}")
    resized = sorted(k for k in layout.shapes if tuple(sd[k].shape) != layout.shapes[k])
    if resized:
        k = resized[0]
        raise InputError(f"refusing {path!r}: {len(resized)} tensor(s) have other shapes than the "
                         f"config says ({_names(resized)}; {k!r} is {layout.shapes[k]}, the config gives "
                         f"{tuple(sd[k].shape)}); expected the checkpoint of this config")
    return params


def read_index(index: str) -> dict:
    """The ``weight_map`` of a shard index ``model.safetensors.index.json``, refused in one
    line unless it is what ``save_pretrained`` writes (a ``metadata`` object and a
    ``weight_map`` of tensor name -> file name: transformers reads both)."""
    expected = ("expected the index save_pretrained writes ({'metadata': {...}, 'weight_map': {tensor: "
                "shard file}})")
    try:
        raw = read_json(index)
    except (OSError, ValueError) as e:
        raise InputError(f"cannot read {index!r} ({quoted(e)}); {expected}") from None
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


#: The largest JSON file (a config, a shard index) a model directory may hold.
JSON_LIMIT = 64 << 20


def read_json(path: str):
    """A model directory's JSON file, bounded: at most :data:`JSON_LIMIT` bytes, nesting Python
    can parse (a ``ValueError`` saying which otherwise)."""
    with open(path, "rb") as f:
        text = f.read(JSON_LIMIT + 1)
    if len(text) > JSON_LIMIT:
        raise ValueError(f"it is over {JSON_LIMIT >> 20} MiB")
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("it is nested too deeply") from None


def refuse_remote_code(path: str) -> None:
    """Refuse a checkpoint whose config asks for its own Python code (``auto_map``), before
    transformers reads it: no code from a model directory ever runs, and nothing prompts."""
    cfg_path = os.path.join(path, "config.json")
    try:
        raw = read_json(cfg_path)
    except OSError:
        return  # unreadable configs are refused by the loader with their own message
    except ValueError as e:
        raise InputError(f"cannot read {cfg_path}: {quoted(e)}; expected a Hugging Face "
                         "config written by save_pretrained") from None
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
    cls = getattr(tf, archs[0], None) if isinstance(archs[0], str) and archs[0].isidentifier() else None
    if not (isinstance(cls, type) and issubclass(cls, tf.PreTrainedModel)):
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
            raise InputError(f"checkpoint {where} has {bad} NaN/inf values in tensor {name!r}; "
                             "expected finite weights (was the model trained with a diverging loss?)")


def _from_pretrained(cls, source, where, **kw):
    kw.setdefault("dtype", "auto")
    # a tensor of another shape is loaded and then refused by refuse_incomplete, naming it
    # (transformers' own refusal points at a report its silenced logger never printed)
    kw.setdefault("ignore_mismatched_sizes", True)
    if hasattr(cls, "set_use_kernels"):
        # transformers ≥ 5.25 swaps layers' forwards for kernels fetched from the Hub by default:
        # code from outside the model's own library, run on its weights; the model is the library's
        kw.setdefault("use_kernels", False)
    try:
        model, info = cls.from_pretrained(source, use_safetensors=True,
                                          output_loading_info=True, trust_remote_code=False, **kw)
    except (OSError, ValueError, RuntimeError, KeyError, EnvironmentError) as e:
        msg = quoted(e, 300)
        raise InputError(f"cannot load {where}: {msg}; expected {EXPECTED} with valid safetensors "
                         "weights") from None
    except Exception as e:  # noqa: BLE001 - safetensors' own errors (truncated, corrupt header)
        msg = quoted(e, 300)
        raise InputError(f"cannot read the weights of {where}: {msg}; expected valid safetensors "
                         "files written by save_pretrained") from None
    refuse_incomplete(info, where, cls.__name__)
    check_weights_finite(model, where)
    model.eval()
    return model


def load_local(path: str):
    """The model of a ``save_pretrained`` directory, loaded completely or refused. The checkpoint
    is read as the out-of-core path reads it first (:func:`read_layout`: files inside the
    directory, index and shards in agreement; the model built on ``meta`` and checked against
    the headers), then loaded in its tensors' dtype (not the config's ``dtype``)."""
    check_checkpoint_dir(path)
    cfg, cls = read_config(path)
    layout = read_layout(path)
    meta = build_meta(cls, cfg, layout, os.path.join(path, "config.json"))
    try:
        check_tensors(meta, layout, path)
    except KeysDiffer:  # names transformers converts on load (fused experts): from_pretrained checks those
        from .converted import refuse_conversion
        refuse_conversion(meta, layout, repr(path))
    model = _from_pretrained(cls, path, repr(path), local_files_only=True, dtype=layout.dtype)
    layout.check_unchanged()  # the weights loaded are those of the files whose headers were checked
    return model


def _offline() -> bool:
    try:
        from huggingface_hub import constants
        return bool(constants.HF_HUB_OFFLINE)
    except Exception:  # noqa: BLE001 - old huggingface_hub
        return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")


def _hub_unreachable(timeout: float = 3.0) -> str | None:
    """Why the Hugging Face hub (its endpoint, ``HF_ENDPOINT``) cannot be reached now, or None:
    one connection attempt of at most ``timeout`` seconds instead of the hub client's retries."""
    import socket
    from urllib.parse import urlsplit
    try:
        from huggingface_hub import constants
        endpoint = constants.ENDPOINT
    except Exception:  # noqa: BLE001 - old huggingface_hub
        endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    url = urlsplit(endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname or "", port), timeout=timeout).close()
    except OSError as e:
        return f"{endpoint} cannot be reached: {e.strerror or type(e).__name__}"
    return None


def _quiet_hub():
    """The hub client's log lines (retries, warnings) kept from the user: a failure is one refusal."""
    import logging
    logging.getLogger("huggingface_hub").setLevel(logging.ERROR)
    try:
        from huggingface_hub.utils import disable_progress_bars
        disable_progress_bars()
    except Exception:  # noqa: BLE001 - old huggingface_hub
        pass


def load_hub(spec: str, hint: str = ""):
    """A hub id, loaded completely or refused; offline (``HF_HUB_OFFLINE``) or with the hub
    out of reach, only from the local cache, and a name it lacks fails at once in one line."""
    tf = quiet_transformers()
    _quiet_hub()
    offline = _offline()
    why = "offline: HF_HUB_OFFLINE is set" if offline else _hub_unreachable()
    try:
        cfg = tf.AutoConfig.from_pretrained(spec, local_files_only=why is not None, trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 - offline, no such repo, ...
        if why is not None:
            raise InputError(f"no model directory {spec!r} here{hint} and it is not in the local hub cache "
                             f"({why}); expected {EXPECTED}, or a hub id the hub can serve") from None
        msg = quoted(e)
        raise InputError(f"no model directory {spec!r} here{hint} and the Hugging Face hub could not load it "
                         f"({msg}); expected {EXPECTED}, or a hub id with safetensors weights") from None
    check_config_numbers(cfg.to_dict(), f"the config of {spec!r}", class_defaults(cfg))
    cls = _model_class(tf, cfg, f"the config of {spec!r}")
    return _from_pretrained(cls, spec, repr(spec), local_files_only=why is not None)
