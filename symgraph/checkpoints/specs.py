"""Inputs of the command line: models (a ``save_pretrained`` directory, a built-in tiny demo
model, or a hub id: :mod:`symgraph.checkpoints` loads them exactly; :func:`as_stored` casts a
model loaded whole back to the dtypes a checkpoint stores) and data files; and whether the
models of a merge can be merged, from their configs, before any work (one architecture, one
configuration apart from the sizes an alignment can bridge, one depth), and what their configs
differ in, for a refusal found later. Writing is :mod:`symgraph.checkpoints.outdir`'s job.
"""
from __future__ import annotations

import os

import torch

from .loading import quiet_transformers, check_checkpoint_dir, load_hub, load_local
from ..core.files import check_input_file
from ..core.configs import METADATA, ConfigsDiffer, check_same_family, config_diff, with_config_diff  # noqa: F401
from ..core.finite import check_token_ids, same_value, zeros_and_ones
from ..errors import InputError
from ..core.progress import note
from ..core.schema import quoted
from ..core.ties import tie_refusal
from .outdir import TOKENIZER_FILES, check_out, save_atomic  # noqa: F401 - re-exported

__all__ = ["DEMO_MODELS", "BATCH_ROWS", "MODEL_EXPECTED", "model_kind", "demo_model", "load_model", "as_stored",
           "load_data", "read_data", "unpadded", "check_checkpoint_dir", "load_local", "check_out", "save_atomic",
           "TOKENIZER_FILES", "check_same_family", "check_same_configs", "config_diff", "with_config_diff",
           "ConfigsDiffer", "width_change", "METADATA", "NOT_FUNCTION"]

DEMO_MODELS = ("tiny-bert", "tiny-gpt2", "tiny-llama", "tiny-vit")
# name -> (symgraph.testing.models architecture, model class, sizes)
_DEMO_SIZES = {
    "tiny-bert": ("bert", None, dict(vocab=128, hidden=32, layers=2, heads=4, mlp=64, positions=64)),
    "tiny-gpt2": ("gpt2", None, dict(vocab=128, hidden=32, layers=2, heads=4, positions=64)),
    "tiny-llama": ("llama", None, dict(vocab=128, hidden=32, layers=2, heads=4, kv_heads=2, mlp=64,
                                       positions=64)),
    "tiny-vit": ("vit", "ViTModel", dict(image_size=16, patch_size=4, channels=3, hidden=32, layers=2,
                                         heads=4, mlp=64)),
}
BATCH_ROWS = 8


# --- built-in demo models ------------------------------------------------------------------


def demo_model(name: str):
    """A tiny random-weight model (seed 0) of a well-known architecture in ``eval()`` mode, like
    a loaded checkpoint; built by :mod:`symgraph.testing.models` with Hugging Face's defaults for
    everything but the sizes."""
    if name not in DEMO_MODELS:
        raise InputError(f"unknown demo model {name!r}; expected one of {', '.join(DEMO_MODELS)}")
    quiet_transformers()
    from ..testing import models
    arch, cls, sizes = _DEMO_SIZES[name]
    return models.build(arch, 0, base="hf", cls=cls, **sizes)


# --- checkpoints ----------------------------------------------------------------------


MODEL_EXPECTED = (f"a save_pretrained directory, a demo name ({', '.join(DEMO_MODELS)}) or an owner/name hub "
                  "id")


def model_kind(spec: str) -> str:
    """What a model argument names: ``"local"`` (a path), ``"demo"`` or ``"hub"`` (an
    ``owner/name`` id). A name that is none of these (no ``/``, not here, not a demo: a typo
    in a local path) is refused at once, before any hub is asked."""
    local = os.path.expanduser(spec)
    if os.path.exists(local) or spec.startswith((".", "/", "~")) or spec.endswith("/") or spec.count("/") > 1:
        return "local"
    if spec in DEMO_MODELS:
        return "demo"
    owner, _, name = spec.partition("/")
    if not (owner and name):
        raise InputError(f"no model directory {spec!r} here; expected {MODEL_EXPECTED}")
    return "hub"


def load_model(spec: str):
    """A local ``save_pretrained`` directory, a demo name, or an ``owner/name`` hub id; loaded
    completely or refused (see :mod:`symgraph.checkpoints`)."""
    kind = model_kind(spec)
    if kind == "local":
        return load_local(os.path.expanduser(spec))
    if kind == "demo":
        return demo_model(spec)
    return load_hub(spec)


def as_stored(model, layout) -> None:
    """Each floating-point tensor of ``model`` (loaded whole) cast to the dtype ``layout`` (a
    checkpoint's headers) stores it in: ``from_pretrained`` loads every tensor in one dtype, the
    out-of-core path writes each in its own; the dtypes follow the tensors, not the config."""
    with torch.no_grad():
        for name, t in list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers()):
            want = layout.dtypes.get(name)
            if want is not None and want.is_floating_point and t.is_floating_point() and t.dtype != want:
                t.data = t.data.to(want)


# --- data ----------------------------------------------------------------------------------


DATA_EXPECTED = ("a .safetensors or .pt file holding a tensor 'input_ids' [N, S] (and optionally its "
                 "'attention_mask'), or 'pixel_values'")


def check_dense(x: torch.Tensor, where: str) -> None:
    """Refuse, in one line, a tensor of a data file that is not a dense CPU tensor holding its
    values: on the meta device (no values), nested (ragged rows), sparse, quantized, another
    device's, or a tensor subclass (whose operations are its own code)."""
    kind = ("a meta-device tensor (a shape without values)" if x.device.type == "meta"
            else "a nested (ragged) tensor" if x.is_nested
            else "a quantized tensor" if x.is_quantized
            else f"a {str(x.layout).removeprefix('torch.')} tensor" if x.layout != torch.strided
            else f"a tensor on {x.device}" if x.device.type != "cpu"
            else f"a {type(x).__name__} (a tensor subclass)" if type(x) not in (torch.Tensor, torch.nn.Parameter)
            else None)
    if kind is not None:
        raise InputError(f"{where} is {kind}; expected a dense CPU tensor of rows (as torch.tensor or "
                         "safetensors' save_file writes one)")


def load_data(path: str, model=None):
    """Batches of ``BATCH_ROWS`` rows from a ``.safetensors``/``.pt`` file with ``input_ids`` or
    ``pixel_values``, the file refused first unless a regular file (:func:`read_data`)."""
    check_input_file(path, "data file", DATA_EXPECTED)
    return read_data(path, model)


def read_data(path: str, model=None):
    """Batches of ``BATCH_ROWS`` rows from data file ``path``, already checked a regular file (a
    merge's :class:`~.inputs.Inputs`, :func:`load_data`). Returns a list of keyword dicts."""
    d = _read_tensors(path)
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
    for k, t in d.items():  # every tensor of the file, read or not, is an ordinary one
        if isinstance(t, torch.Tensor):
            check_dense(t, f"{str(k)[:80]!r} in {path!r}")
    x = x.detach()
    x = _token_ids(x, path, getattr(model, "config", None)) if key == "input_ids" else _pixels(x, path)
    unused = sorted(k for k in d if k not in (key, "attention_mask"))
    if unused:
        note(f"data file {path!r} holds {unused}, which symgraph does not read (it reads {key!r} and "
             "'attention_mask')", "warning")
    if "attention_mask" in d:
        batches = unpadded(x, d["attention_mask"], path) if key == "input_ids" else _no_mask(path, key)
    else:  # batches of BATCH_ROWS rows and a last, smaller one (traced again for its shape): no row dropped
        batches = [{key: x[i:i + BATCH_ROWS]} for i in range(0, x.shape[0], BATCH_ROWS)]
    return with_decoder_ids(model, batches) if key == "input_ids" else batches


def with_decoder_ids(model, batches: list) -> list:
    """``batches`` of an encoder-decoder model (``config.is_encoder_decoder``, a forward that takes
    ``decoder_input_ids``) with the decoder's ids added: each row's tokens shifted right behind
    the decoder's start token, the teacher-forced input of a model asked to reproduce its input
    (a data file holds one text per row). Other models' batches as they are."""
    import inspect
    cfg = getattr(model, "config", None)
    try:
        takes = "decoder_input_ids" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError, AttributeError):
        takes = False
    if not getattr(cfg, "is_encoder_decoder", False) or not takes:
        return batches
    from ..passes.input_values import config_value, ints
    start = (ints(config_value(cfg, "decoder_start_token_id", "pad_token_id")) or [0])[0]
    out = []
    for b in batches:
        ids = b["input_ids"]
        dec = torch.cat([torch.full_like(ids[:, :1], start), ids[:, :-1]], dim=1)
        out.append({**b, "decoder_input_ids": dec})
    return out


def _read_tensors(path: str) -> dict:
    """The tensors of a data file by name (a ``.pt`` file's lone tensor as ``input_ids``), read
    without running code, or refused in one line."""
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file
        try:
            d = load_file(path)
        except Exception as e:  # noqa: BLE001
            raise InputError(f"cannot read data file {path!r}: {quoted(e)}; expected a valid safetensors file") from None
    elif path.endswith((".pt", ".pth")):
        try:
            d = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - torch's advice (load with weights_only=False) left out
            why = " ".join((str(e).partition("WeightsUnpickler error:")[2] or str(e)).split())
            raise InputError(f"cannot read data file {path!r} with weights_only=True (symgraph runs no code "
                             f"from a file): {quoted(why.partition(' Check the documentation')[0])}; expected "
                             "a dict of tensors or a tensor") from None
        if isinstance(d, torch.Tensor):
            d = {"input_ids": d}
    else:
        raise InputError(f"data file {path!r} has an unknown extension; expected .safetensors or .pt")
    if not isinstance(d, dict):
        raise InputError(f"data file {path!r} holds a {type(d).__name__}; expected a dict with a tensor "
                         "'input_ids' [N, S] or 'pixel_values' [N, C, H, W]")
    return d


def _token_ids(x: torch.Tensor, path: str, cfg) -> torch.Tensor:
    """``input_ids`` as int64, refused unless a 2-d tensor of ids in the vocabulary of the
    model's config ``cfg`` (any non-negative id without one), rows no longer than its positions."""
    if x.dim() != 2 or x.shape[0] < 1 or x.shape[1] < 1:
        raise InputError(f"'input_ids' in {path!r} has shape {tuple(x.shape)}; expected a 2-d tensor "
                         "[N, S] of token ids (N ≥ 1 rows of S ≥ 1 tokens)")
    check_token_ids(x, f"'input_ids' in {path!r}", cfg)
    x = x.long()
    maxpos = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
    if maxpos and x.shape[1] > maxpos:
        raise InputError(f"'input_ids' in {path!r} has {x.shape[1]} tokens per row; expected at "
                         f"most {maxpos} (the model's max_position_embeddings)")
    return x


def _pixels(x: torch.Tensor, path: str) -> torch.Tensor:
    """``pixel_values`` as float32, refused unless a 4-d tensor of finite floating-point values."""
    if x.dim() != 4:
        raise InputError(f"'pixel_values' in {path!r} has shape {tuple(x.shape)}; expected a 4-d "
                         "tensor [N, C, H, W]")
    if not x.is_floating_point():
        raise InputError(f"'pixel_values' in {path!r} has dtype {str(x.dtype).removeprefix('torch.')}; expected "
                         "floating-point pixel values (the image processor's output, not raw bytes)")
    x = x.float()
    if not torch.isfinite(x).all():
        raise InputError(f"'pixel_values' in {path!r} contains NaN/inf; expected finite values")
    return x


def _no_mask(path, key):
    raise InputError(f"data file {path!r} holds an 'attention_mask' beside {key!r}; expected a mask only with "
                     "'input_ids' (token rows and their padding)")


def unpadded(ids: torch.Tensor, mask, path: str = "data") -> list:
    """Batches of the rows of ``ids`` with their padding (``mask`` 0) cut off, rows of one length
    together (``BATCH_ROWS`` at most; each length is traced once): every step that reads data
    (activation statistics, RegMean's Grams, REPAIR, the barrier's loss, compare) then sees the
    tokens alone, as if each row had been given unpadded. A row's mask must be ones then zeros
    (right padding) or zeros then ones (left padding), with at least one token."""
    if not isinstance(mask, torch.Tensor) or mask.shape != ids.shape:
        shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise InputError(f"'attention_mask' in {path!r} has shape {shape}; expected {tuple(ids.shape)}, the "
                         "shape of 'input_ids'")
    if not zeros_and_ones(mask):
        raise InputError(f"'attention_mask' in {path!r} holds values other than 0 and 1 (dtype "
                         f"{str(mask.dtype).removeprefix('torch.')}); expected 1 for a token, 0 for padding")
    m = mask.bool()
    n = m.sum(1)
    steps = (m[:, 1:] != m[:, :-1]).sum(1)
    bad = ((n == 0) | (steps > 1)).nonzero().flatten().tolist()
    if bad:
        what = "all zeros" if n[bad[0]] == 0 else "not one run of ones"
        raise InputError(f"'attention_mask' in {path!r} row {bad[0]} is {what}; expected each row ones then zeros "
                         "(right padding) or zeros then ones (left padding)")
    by_length: dict = {}
    for i in range(ids.shape[0]):
        by_length.setdefault(int(n[i]), []).append(ids[i][m[i]])
    return [{"input_ids": torch.stack(rows[j:j + BATCH_ROWS])} for _, rows in sorted(by_length.items(), reverse=True)
            for j in range(0, len(rows), BATCH_ROWS)]


# --- the models of a merge compared, from their configs --------------------------------------

#: Config fields that do not change what a model computes in evaluation: metadata and run-time flags.
NOT_FUNCTION = METADATA | {"use_cache", "return_dict", "output_attentions", "output_hidden_states", "torchscript",
                 "id2label", "label2id", "tokenizer_class", "task_specific_params", "finetuning_task", "prefix",
                 "initializer_range", "initializer_factor", "attn_implementation", "_attn_implementation",
                 "_attn_implementation_autoset", "problem_type"}

#: The config field that ties a language model's head to its embedding (transformers' name).
TIE = "tie_word_embeddings"


def check_same_configs(configs, names, untie: bool = False):
    """Refuse, before any work, models whose configs differ in a field that changes the function
    but not the tensors' shapes (an activation, a RoPE base, a norm epsilon, a flag): the merged
    model would silently follow the anchor's. Integer fields (sizes) are left to the shape
    checks, which know which widths an alignment can bridge (a size left to its default, None,
    likewise); dropout rates do not count. A
    sub-config (a vision-language model's ``text_config``) is compared field by field by the
    same rules: its ``dtype``, which loading stamps, is as much metadata as the top level's.
    A tied head and an untied one (``tie_word_embeddings``) are one function, the untied form
    the larger: accepted where the job unties (``untie``), else refused naming the option."""
    if any(c is None for c in configs):
        return
    base = configs[0].to_dict()
    for name, c in zip(names[1:], configs[1:]):
        d = c.to_dict()
        kinds = [(x.get("architectures") or [x.get("model_type")])[0] for x in (base, d)]
        if kinds[0] != kinds[1]:
            raise ConfigsDiffer(f"{names[0]!r} is a {kinds[0]} but {name!r} is a {kinds[1]}; expected models of "
                             "one architecture")
        found = _difference(base, d, skip=NOT_FUNCTION | ({TIE} if untie else set()))
        if found is None:
            continue
        path, a, b, sub_a, sub_b = found
        if isinstance(a, list) and isinstance(b, list) and len(a) != len(b):
            _refuse_count(sub_a, sub_b, path.rsplit(".", 1)[-1], (names[0], name))
        if path.rsplit(".", 1)[-1] == TIE:
            tied, loose = (names[0], name) if a else (name, names[0])
            raise ConfigsDiffer(str(tie_refusal(repr(tied), repr(loose), f" (config field {path!r}: {a!r} vs {b!r})")))
        raise ConfigsDiffer(f"{names[0]!r} and {name!r} differ in config field {path!r} ({a!r} vs {b!r}), which "
                         "changes what the model computes; expected models of one configuration (apart "
                         "from widths an alignment can bridge)")


def _difference(a: dict, b: dict, prefix: str = "", skip=NOT_FUNCTION):
    """``(path, value in a, value in b, a, b)`` of the first field of two config dicts that changes
    the function (the rules of :func:`check_same_configs`; ``skip``: the fields that do not),
    descending into sub-configs (dicts that name a ``model_type``); None where there is none."""
    for k in sorted(set(a) | set(b)):
        x, y = a.get(k), b.get(k)
        if k in skip or same_value(x, y) or "dropout" in k or "pdrop" in k:
            continue
        if all(v is None or (isinstance(v, int) and not isinstance(v, bool)) for v in (x, y)):
            continue  # sizes, one perhaps left to its default (GPT-2's n_inner None: 4 × n_embd)
        if isinstance(x, dict) and isinstance(y, dict) and "model_type" in x and "model_type" in y:
            found = _difference(x, y, f"{prefix}{k}.", skip)
            if found is not None:
                return found
            continue
        return f"{prefix}{k}", x, y, a, b
    return None


def _refuse_count(a: dict, b: dict, key: str, names) -> None:
    """Configs whose list ``key`` has one entry per item of a count they differ in (``layer_types``
    and ``num_hidden_layers``): refused naming the count, as a user would."""
    n, m = len(a[key]), len(b[key])
    count = next((k for k, v in a.items() if v == n and b.get(k) == m and type(v) is int), None)
    what = f"config field {count!r} ({n} vs {m}; {key!r} has one entry each)" if count else \
        f"config field {key!r} ({n} vs {m} entries)"
    raise ConfigsDiffer(f"{names[0]!r} and {names[1]!r} differ in {what}; expected models of one depth (a merge "
                     "pairs their layers one to one)")


def width_change(configs, names, anchor: int = 0) -> list:
    """The sizes in which a model's config differs from the anchor's (``configs[anchor]``), as
    ``"'b': intermediate_size 64 -> 48"``: widths the alignment bridges by transport (the merge has
    the anchor's); empty when every model has the anchor's sizes."""
    if any(c is None for c in configs):
        return []
    base = configs[anchor].to_dict()
    out = []
    for name, c in zip(names, configs):
        d = c.to_dict()
        diffs = [f"{k} {d[k]} -> {base[k]}" for k in sorted(set(base) & set(d))
                 if k not in NOT_FUNCTION and type(base[k]) is int and type(d[k]) is int and base[k] != d[k]]
        if diffs:
            out.append(f"{name!r}: {', '.join(diffs)}")
    return out
