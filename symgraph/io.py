"""Loading and saving checkpoints for the command line: local ``save_pretrained`` directories,
built-in tiny demo models, hub ids, data files, and atomic writes of merged models.

Weights are read with ``safetensors`` (never unpickled); a ``pytorch_model.bin`` is read with
``torch.load(weights_only=True)``.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import tempfile

import torch

from .errors import InputError

DEMO_MODELS = ("tiny-bert", "tiny-gpt2", "tiny-llama", "tiny-vit")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt",
                   "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json",
                   "spiece.model", "sentencepiece.bpe.model", "preprocessor_config.json")
BATCH_ROWS = 8


def _quiet_transformers():
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import transformers
    transformers.logging.set_verbosity_error()
    try:
        transformers.logging.disable_progress_bar()
    except AttributeError:  # pragma: no cover
        pass
    return transformers


# --- built-in demo models ------------------------------------------------------------------


def demo_model(name: str):
    """A tiny random-weight model (seed 0) of a well-known architecture."""
    tf = _quiet_transformers()
    torch.manual_seed(0)
    if name == "tiny-bert":
        cfg = tf.BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                            intermediate_size=64, max_position_embeddings=64)
        cfg.architectures = ["BertForMaskedLM"]
        return tf.BertForMaskedLM(cfg)
    if name == "tiny-gpt2":
        cfg = tf.GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64)
        cfg.architectures = ["GPT2LMHeadModel"]
        return tf.GPT2LMHeadModel(cfg)
    if name == "tiny-llama":
        cfg = tf.LlamaConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64)
        cfg.architectures = ["LlamaForCausalLM"]
        return tf.LlamaForCausalLM(cfg)
    if name == "tiny-vit":
        cfg = tf.ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32,
                           num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
        cfg.architectures = ["ViTModel"]
        return tf.ViTModel(cfg)
    raise InputError(f"unknown demo model {name!r}; expected one of {', '.join(DEMO_MODELS)}")


# --- local checkpoints ---------------------------------------------------------------------


def _weights_file(path: str):
    for fn in ("model.safetensors", "pytorch_model.bin"):
        p = os.path.join(path, fn)
        if os.path.isfile(p):
            return p
    return None


def check_checkpoint_dir(path: str):
    """Refuse a missing path or a directory without a config or weights."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"model path {path!r} does not exist; expected a directory written by "
                                "save_pretrained (config.json + model.safetensors)")
    if not os.path.isdir(path):
        raise InputError(f"model path {path!r} is a file; expected a directory written by "
                         "save_pretrained (config.json + model.safetensors)")
    missing = []
    if not os.path.isfile(os.path.join(path, "config.json")):
        missing.append("config.json")
    if _weights_file(path) is None:
        if any(f.endswith(".safetensors.index.json") or f.endswith(".bin.index.json") for f in os.listdir(path)):
            raise InputError(f"{path!r} holds a sharded checkpoint, which is not supported; expected a "
                             "single model.safetensors")
        missing.append("model.safetensors (or pytorch_model.bin)")
    if missing:
        raise InputError(f"directory {path!r} has no {' and no '.join(missing)}; expected a "
                         "save_pretrained directory (config.json + model.safetensors)")


def _check_tensors_finite(sd: dict, where: str):
    for k, v in sd.items():
        if torch.is_floating_point(v) and not torch.isfinite(v).all():
            bad = int((~torch.isfinite(v)).sum())
            raise InputError(f"checkpoint {where!r} has {bad} NaN/inf values in tensor {k!r}; expected "
                             "finite weights (was the model trained with a diverging loss?)")


def load_local(path: str):
    """Build the model class named in ``config.architectures[0]`` and load its weights."""
    check_checkpoint_dir(path)
    tf = _quiet_transformers()
    try:
        cfg = tf.AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as e:
        raise InputError(f"cannot read {os.path.join(path, 'config.json')}: {e}; expected a "
                         "Hugging Face config written by save_pretrained") from None
    archs = getattr(cfg, "architectures", None) or []
    if not archs:
        raise InputError(f"{os.path.join(path, 'config.json')} has no 'architectures' entry; expected "
                         "the model class name (e.g. [\"BertForMaskedLM\"]) as save_pretrained writes it")
    cls = getattr(tf, archs[0], None)
    if cls is None:
        raise InputError(f"config architecture {archs[0]!r} is not a transformers class; expected a "
                         "model class available in the installed transformers")
    wf = _weights_file(path)
    if wf.endswith(".safetensors"):
        from safetensors.torch import load_file
        try:
            sd = load_file(wf)
        except Exception as e:  # noqa: BLE001 - corrupt file
            raise InputError(f"cannot read {wf!r}: {e}; expected a valid safetensors file") from None
    else:
        try:
            sd = torch.load(wf, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001
            raise InputError(f"cannot read {wf!r} with weights_only=True: {e}; expected a plain state "
                             "dict (convert it to model.safetensors)") from None
    _check_tensors_finite(sd, path)
    torch.manual_seed(0)
    model = cls(cfg)
    missing, unexpected = _load_state(model, sd)
    if unexpected and len(unexpected) == len(sd):
        raise InputError(f"none of the tensors in {wf!r} match {archs[0]}'s parameters (e.g. "
                         f"{unexpected[0]!r}); expected weights saved from that class")
    model.eval()
    return model


def _load_state(model, sd):
    own = model.state_dict()
    sd = dict(sd)
    # accept weights saved from a base model or with a base-model prefix
    prefix = getattr(model, "base_model_prefix", "")
    if prefix and not any(k in own for k in sd):
        if all(f"{prefix}.{k}" in own for k in list(sd)[:5]):
            sd = {f"{prefix}.{k}": v for k, v in sd.items()}
    for k, v in sd.items():
        if k in own and tuple(own[k].shape) != tuple(v.shape):
            raise InputError(f"tensor {k!r} has shape {tuple(v.shape)} in the checkpoint but "
                             f"{tuple(own[k].shape)} in the config's model; expected matching shapes")
    res = model.load_state_dict(sd, strict=False)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    return res.missing_keys, res.unexpected_keys


def load_model(spec: str):
    """A local directory, a demo name, or (if neither) a hub id."""
    local = os.path.expanduser(spec)
    if os.path.exists(local) or spec.startswith((".", "/", "~")) or spec.endswith("/") or spec.count("/") > 1:
        return load_local(local)
    if spec in DEMO_MODELS:
        return demo_model(spec)
    tf = _quiet_transformers()
    try:
        cfg = tf.AutoConfig.from_pretrained(spec)
        archs = getattr(cfg, "architectures", None) or []
        cls = (getattr(tf, archs[0], None) if archs else None) or tf.AutoModel
        m = cls.from_pretrained(spec, use_safetensors=True)
    except Exception as e:  # noqa: BLE001 - offline, no such repo, ...
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise FileNotFoundError(
            f"{spec!r} is not a local path, not a built-in demo ({', '.join(DEMO_MODELS)}), and "
            f"could not be loaded from the Hugging Face hub ({msg}); expected a save_pretrained "
            "directory, a demo name, or a reachable hub id with safetensors weights") from None
    m.eval()
    return m


# --- data ----------------------------------------------------------------------------------


def load_data(path: str, model=None):
    """Batches of ``BATCH_ROWS`` rows from a ``.safetensors``/``.pt`` file with ``input_ids`` or
    ``pixel_values``. Returns a list of keyword dicts."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"data file {path!r} does not exist; expected a .safetensors or .pt "
                                "file holding a tensor 'input_ids' [N, S] (or 'pixel_values')")
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file
        try:
            d = load_file(path)
        except Exception as e:  # noqa: BLE001
            raise InputError(f"cannot read data file {path!r}: {e}; expected a valid safetensors file") from None
    elif path.endswith((".pt", ".pth")):
        try:
            d = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001
            raise InputError(f"cannot read data file {path!r} with weights_only=True: {e}; expected a "
                             "dict of tensors or a tensor") from None
        if isinstance(d, torch.Tensor):
            d = {"input_ids": d}
    else:
        raise InputError(f"data file {path!r} has an unknown extension; expected .safetensors or .pt")
    if not isinstance(d, dict):
        raise InputError(f"data file {path!r} holds a {type(d).__name__}; expected a dict with a tensor "
                         "'input_ids' [N, S] or 'pixel_values' [N, C, H, W]")
    main = getattr(model, "main_input_name", None) if model is not None else None
    key = main if main in d else next((k for k in ("input_ids", "pixel_values") if k in d), None)
    if key is None:
        raise InputError(f"data file {path!r} has keys {sorted(d)}; expected a tensor 'input_ids' [N, S] "
                         "or 'pixel_values' [N, C, H, W]")
    if main and key != main:
        raise InputError(f"data file {path!r} holds {key!r} but the model's input is {main!r}; expected "
                         f"a tensor {main!r}")
    x = d[key]
    if not isinstance(x, torch.Tensor):
        raise InputError(f"{key!r} in {path!r} is a {type(x).__name__}; expected a tensor")
    if key == "input_ids":
        if x.dim() != 2 or x.shape[0] < 1 or x.shape[1] < 1:
            raise InputError(f"'input_ids' in {path!r} has shape {tuple(x.shape)}; expected a 2-d tensor "
                             "[N, S] of token ids (N rows, S tokens)")
        if torch.is_floating_point(x):
            raise InputError(f"'input_ids' in {path!r} has dtype {x.dtype}; expected integer token ids")
        x = x.long()
        cfg = getattr(model, "config", None)
        vocab = getattr(cfg, "vocab_size", None)
        if vocab is not None and (int(x.min()) < 0 or int(x.max()) >= vocab):
            raise InputError(f"'input_ids' in {path!r} range over [{int(x.min())}, {int(x.max())}]; "
                             f"expected ids in [0, {vocab - 1}] (the model's vocabulary)")
        maxpos = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
        if maxpos and x.shape[1] > maxpos:
            raise InputError(f"'input_ids' in {path!r} has {x.shape[1]} tokens per row; expected at "
                             f"most {maxpos} (the model's max_position_embeddings)")
    else:
        if x.dim() != 4:
            raise InputError(f"'pixel_values' in {path!r} has shape {tuple(x.shape)}; expected a 4-d "
                             "tensor [N, C, H, W]")
        x = x.float()
        if not torch.isfinite(x).all():
            raise InputError(f"'pixel_values' in {path!r} contains NaN/inf; expected finite values")
    n = x.shape[0]
    rows = min(BATCH_ROWS, n)
    nb = max(1, n // rows)  # equal-shaped batches: a partial last batch is dropped
    return [{key: x[i * rows:(i + 1) * rows]} for i in range(nb)]


# --- writing -------------------------------------------------------------------------------


def check_out(out: str, force: bool):
    out = os.path.abspath(out)
    if os.path.exists(out) and not force:
        raise InputError(f"output {out!r} already exists; pass --force to replace it, or choose a new "
                         "--out directory")
    parent = os.path.dirname(out)
    if not os.path.isdir(parent):
        raise FileNotFoundError(f"the parent directory of --out {out!r} does not exist; expected an "
                                "existing directory to write into")
    return out


def save_atomic(model, out: str, *, tokenizer_from=None, meta=None, force=False):
    """``save_pretrained`` into a temp dir next to ``out``, then rename it into place."""
    out = check_out(out, force)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.tmp-", dir=os.path.dirname(out))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        if tokenizer_from and os.path.isdir(tokenizer_from):
            for fn in TOKENIZER_FILES:
                src = os.path.join(tokenizer_from, fn)
                if os.path.isfile(src):
                    shutil.copy2(src, os.path.join(tmp, fn))
        if meta is not None:
            with open(os.path.join(tmp, "symgraph_merge.json"), "w") as f:
                json.dump(_jsonable(meta), f, indent=2)
        if os.path.exists(out):
            old = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.old-", dir=os.path.dirname(out))
            os.rmdir(old)
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True) if os.path.isdir(old) else os.unlink(old)
        else:
            os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float):
        return x if math.isfinite(x) else str(x)
    if isinstance(x, (str, int, bool)) or x is None:
        return x
    if isinstance(x, torch.Tensor) and x.numel() == 1:
        return float(x)
    try:
        return float(x)
    except (TypeError, ValueError):
        return str(x)
