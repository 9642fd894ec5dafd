"""Optional inputs a forward takes that read parameters the main input alone leaves unread (see
:mod:`.inputs`): a parameter the traced program never reads fixes every class, so the example
inputs reach it as a user's inputs would. An optional input is kept only where the model's own
forward runs on it (a trial run in eval mode, without gradients, on any device, ``meta``
included) and reads a parameter it read on none of the inputs before; a forward that refuses
it, or takes it and ignores it, keeps the inputs it had.

- encoder states (``encoder_hidden_states``; ``encoder_outputs``: Whisper's causal LM;
  ``cross_attention_states``: Mllama's) for a decoder used alone whose layers hold
  cross-attention (the causal LMs of BART, Pegasus, Marian): four positions of its width;
  RoBERTa's masked LM takes them and ignores them, BERT as a decoder refuses them;
- entities (``entity_ids`` in range of the config's ``entity_vocab_size``, each mentioned at
  token positions ``entity_position_ids``: LUKE), read by their own embeddings and attention;
- token ids alone, lengthened where they leave a parameter unread (DeepSeek V4's compressor
  reads windows of 128 tokens);
- masked patches (``bool_masked_pos``: DINOv2): every third patch replaced by the learned mask
  token, the same idea as Wav2Vec2's masked frames;
- a document's layout (``bbox``: LayoutLMv3, LiLT, UDOP): a box per token, and its page image
  (``pixel_values``) where the forward takes one beside the ids and no image token places it;
- two segments (``token_type_ids``: XLNet's segment embeddings and bias are read only on them);
- positions to predict (``target_mapping``, ``perm_mask``: XLNet's query stream, which reads its
  mask embedding), built as its own generation builds them: the last token, seen by no position.
"""
from __future__ import annotations

import contextlib
import inspect
import logging

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..core.dtypes import parameters_dtype
from ..core.modes import set_mode
from .input_values import config_value, device_of, pixels, token_ids

__all__ = ["Trials", "float_leaves", "forward_hooks", "caches_off", "encoder_states", "entities", "layout",
           "long_enough", "masked_patches", "modules_above", "parameter_reads", "passes_on", "segments_and_targets", "text_extras"]

# the names transformers gives a decoder's encoder states (BART's, Whisper's causal LM; Mllama's)
_ENCODER_STATES = ("encoder_hidden_states", "encoder_outputs", "cross_attention_states")


def float_leaves(tree) -> list:
    """The floating-point tensors among the leaves of ``tree`` (args, kwargs, a module's output)."""
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]


def passes_on(model, params, name: str) -> bool:
    """Whether the forward takes ``name``: by name, or in its ``**kwargs`` where a submodule's
    forward takes it by name (a classification head hands them to its backbone)."""
    if name in params:
        return True
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return False
    return any(name in inspect.signature(m.forward).parameters for m in model.modules() if m is not model)


class _Reads(TorchDispatchMode):
    """Records which of ``names`` (tensor id -> parameter name) any op takes."""

    def __init__(self, names: dict):
        super().__init__()
        self.names, self.seen = names, set[str]()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for a in tree_flatten((args, kwargs or {}))[0]:
            if isinstance(a, torch.Tensor) and id(a) in self.names:
                self.seen.add(self.names[id(a)])
        return func(*args, **(kwargs or {}))


def parameter_reads(model, args: tuple, kwargs: dict, run=None) -> frozenset | None:
    """Names of the parameters ``model``'s forward (or ``run``, a method of it or of a module
    in it) reads on ``args``/``kwargs`` (floating ones put in the parameters' dtype, all on its
    device), run in eval mode without gradients (each module's mode restored after); None where
    it refuses them."""
    dev = device_of(model)
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    put = lambda v: (v.to(dev, dtype) if v.is_floating_point() else v.to(dev)) \
        if isinstance(v, torch.Tensor) else v  # noqa: E731
    flags = [(m, m.training) for m in model.modules()]
    mode = _Reads({id(p): n for n, p in model.named_parameters()})
    # on meta, under fake tensors as torch.export runs it (transformers skips its checks of
    # values there, which no meta tensor holds); the parameters' reads are seen before
    fake = FakeTensorMode(allow_non_fake_inputs=True) if dev.type == "meta" else contextlib.nullcontext()
    log = logging.getLogger("torch._subclasses.fake_tensor")  # logs each refusal under fake tensors
    level = log.level
    try:
        log.setLevel(logging.CRITICAL)
        with torch.no_grad(), fake, mode, parameters_dtype(model):  # as the trace runs it
            set_mode(model, False)
            (run or model)(*(put(a) for a in args), **{k: put(v) for k, v in kwargs.items()})
    except Exception:  # noqa: BLE001 - the forward refuses these inputs
        return None
    finally:
        log.setLevel(level)
        for m, f in flags:
            m.training = f
    return frozenset(mode.seen)


class Trials:
    """Trial runs of ``model`` on ``kwargs`` (the example inputs so far, updated in place by
    :meth:`offer`): the parameters the forward reads on them, found once."""

    def __init__(self, model, kwargs: dict):
        self.model, self.kwargs = model, kwargs
        self._base: tuple[dict | None, frozenset] = (None, frozenset())

    def reads(self, kwargs: dict) -> frozenset | None:
        """Names of the parameters the forward reads on ``kwargs``; None where it refuses them."""
        model = self.model
        trial = dict(kwargs)
        if "use_cache" in inspect.signature(model.forward).parameters:
            trial["use_cache"] = False
        return parameter_reads(model, (), trial)

    def base(self) -> frozenset:
        """The parameters the forward reads on the inputs as they are (none: it refuses them)."""
        now = {k: id(v) for k, v in self.kwargs.items()}
        if self._base[0] != now:  # the inputs changed since the last trial
            self._base = (now, self.reads(self.kwargs) or frozenset())
        return self._base[1]

    def offer(self, extra: dict) -> bool:
        """Add ``extra`` to the inputs (or put it in place of those of the same name) where the
        forward runs on them and reads a parameter it read on none before; whether it did."""
        base = self.base()
        new = self.reads({**self.kwargs, **extra})
        if new is None or not new - base:
            return False
        self.kwargs.update(extra)
        self._base = ({k: id(v) for k, v in self.kwargs.items()}, new)
        return True


def caches_off(model, trials: Trials, params) -> None:
    """``use_cache=False`` where the forward takes it only through its ``**kwargs`` and refuses
    the inputs without it while it runs on them with it: a decoder that reads its config's
    ``use_cache`` builds a cache, and a hybrid one of linear-attention layers only cannot say how
    long it is (Qwen3.5's vision-language model at two layers: "``get_seq_length`` can only be
    called on Attention layers"). A forward that runs without it keeps its inputs (T5Gemma's
    classifier refuses it)."""
    if "use_cache" in params or not passes_on(model, params, "use_cache"):
        return
    if trials.reads(trials.kwargs) is None and trials.reads({**trials.kwargs, "use_cache": False}) is not None:
        trials.kwargs["use_cache"] = False


def _pair(v):
    return tuple(v) if isinstance(v, (tuple, list)) else (v, v)


def masked_patches(model, trials: Trials, params, batch) -> None:
    """Masked patches (``bool_masked_pos``, where the forward or, through its ``**kwargs``, its
    backbone takes it): every third of the image's patches (its size over the config's patch
    size), where the forward reads the mask token on them (ViT's classifier has none)."""
    images = trials.kwargs.get("pixel_values")
    if images is None or images.dim() != 4 or not passes_on(model, params, "bool_masked_pos"):
        return
    (ph, pw), (h, w) = _pair(config_value(model.config, "patch_size")), images.shape[-2:]
    if not all(isinstance(x, int) and x > 0 for x in (ph, pw)):
        return
    mask = torch.zeros(batch, (h // ph) * (w // pw), dtype=torch.bool)
    mask[:, 1::3] = True
    trials.offer({"bool_masked_pos": mask})


def encoder_states(trials: Trials, params, cfg, batch, gen) -> None:
    """Encoder states under the first name the forward takes them by (see the module's
    docstring): four positions of the width the config gives cross-attention's input."""
    width = config_value(cfg, "cross_attention_hidden_size", "encoder_hidden_size", "d_model", "hidden_size")
    name = next((n for n in _ENCODER_STATES if n in params), None)
    if name is not None and isinstance(width, int):
        trials.offer({name: torch.randn(batch, 4, width, generator=gen)})


def entities(trials: Trials, params, cfg, batch, gen) -> None:
    """Two entities a row (see the module's docstring), none the padding entity 0: the first
    mentioned by the first two tokens, the second by the third (positions padded with -1)."""
    n, ids = config_value(cfg, "entity_vocab_size"), trials.kwargs.get("input_ids")
    if not {"entity_ids", "entity_position_ids"} <= set(params) or not isinstance(n, int) or n < 2 \
            or ids is None or ids.shape[1] < 3:
        return
    extra = {"entity_ids": torch.randint(1, n, (batch, 2), generator=gen),
             "entity_position_ids": torch.tensor([[0, 1], [2, -1]]).expand(batch, 2, 2).clone()}
    if "entity_attention_mask" in params:
        extra["entity_attention_mask"] = torch.ones(batch, 2, dtype=torch.long)
    trials.offer(extra)


LONGEST = 128  # the longest example sequence tried (DeepSeek V4 compresses windows of 128)


def long_enough(model, trials: Trials, cfg, batch, gen) -> None:
    """Where the forward takes token ids alone and leaves a parameter unread on them, and reads
    more on ids of :data:`LONGEST` (or the config's positions), the shortest of twice the length,
    and again, on which it does (a compressor that reads only whole windows of tokens)."""
    ids = trials.kwargs.get("input_ids")
    if set(trials.kwargs) != {"input_ids"} or ids is None:
        return
    if trials.base() >= {n for n, _ in model.named_parameters()}:
        return
    maxpos = config_value(cfg, "max_position_embeddings", "n_positions")
    top = min(LONGEST, maxpos) if isinstance(maxpos, int) and maxpos > 0 else LONGEST
    if top <= ids.shape[1]:
        return
    longest = token_ids(model, cfg, batch, top, gen)
    reads = trials.reads({"input_ids": longest})
    if reads is None or not reads - trials.base():  # (one trial for a parameter no ids read)
        return
    seq = ids.shape[1] * 2
    while seq < top and not trials.offer({"input_ids": token_ids(model, cfg, batch, seq, gen)}):
        seq *= 2
    if seq >= top:
        trials.offer({"input_ids": longest})


def layout(trials: Trials, params, cfg, batch, gen) -> None:
    """A document's layout: a box per token (``bbox``: ``x0 < x1``, ``y0 < y1``), integer
    coordinates below the config's ``max_2d_position_embeddings`` as LayoutLM's processors make
    them, else the same boxes as fractions of the page (UDOP reads them in ``[0, 1]``); then the
    page's image (``pixel_values`` at the vision config's size, else the config's) where the
    forward takes one and no image token places it (LayoutLMv3's and UDOP's patch embeddings)."""
    ids = trials.kwargs.get("input_ids")
    if ids is not None and "bbox" in params and "bbox" not in trials.kwargs:
        top = config_value(cfg, "max_2d_position_embeddings")
        top = top if isinstance(top, int) and top > 4 else 1000
        lo = torch.randint(0, top // 2, (*ids.shape, 2), generator=gen)
        hi = lo + torch.randint(1, top // 2, (*ids.shape, 2), generator=gen)
        box = torch.stack([lo[..., 0], lo[..., 1], hi[..., 0], hi[..., 1]], dim=-1)
        if not trials.offer({"bbox": box}):
            trials.offer({"bbox": box.float() / top})
    if "bbox" in params and "pixel_values" in params and "pixel_values" not in trials.kwargs \
            and config_value(cfg, "image_token_id", "image_token_index") is None:
        trials.offer({"pixel_values": pixels(trials.model, config_value(cfg, "vision_config") or cfg, batch, gen)})


def segments_and_targets(trials: Trials, params, cfg, batch: int) -> None:
    """Two segments of the token ids (``token_type_ids``: the first half 0, the rest 1) where the
    config allows two types; then the positions to predict (``target_mapping``: one, the last
    token; ``perm_mask``: no position sees it, as XLNet's ``prepare_inputs_for_generation``
    builds them). Each kept only where the forward reads a parameter more on it."""
    ids = trials.kwargs.get("input_ids")
    if ids is None or ids.dim() != 2 or ids.shape[1] < 2:
        return
    seq, types = ids.shape[1], config_value(cfg, "type_vocab_size")
    if "token_type_ids" in params and "token_type_ids" not in trials.kwargs \
            and (not isinstance(types, int) or types >= 2):
        trials.offer({"token_type_ids": (torch.arange(seq) >= seq // 2).long().expand(batch, seq).clone()})
    if {"target_mapping", "perm_mask"} <= set(params) and "target_mapping" not in trials.kwargs:
        target = torch.zeros(batch, 1, seq)
        target[:, 0, -1] = 1.0
        perm = torch.zeros(batch, seq, seq)
        perm[:, :, -1] = 1.0
        trials.offer({"target_mapping": target, "perm_mask": perm})


def text_extras(trials: Trials, params, cfg, batch: int, gen) -> None:
    """What token ids may come with: a document's layout (:func:`layout`), then segments and the
    positions to predict (:func:`segments_and_targets`)."""
    layout(trials, params, cfg, batch, gen)
    segments_and_targets(trials, params, cfg, batch)


def modules_above(names) -> list[str]:
    """The paths of the modules above the parameters ``names``, nearest first, the model
    (``""``) last: where a lever that makes a parameter read is looked for."""
    paths: dict = {}
    for name in names:
        parts = name.split(".")[:-1]
        for k in range(len(parts), -1, -1):
            paths.setdefault(".".join(parts[:k]), None)
    return sorted(paths, key=lambda p: -len(p.split(".")) if p else 0)


@contextlib.contextmanager
def forward_hooks(model, hooks):
    """While inside, each ``(path, hook)`` of ``hooks`` is a forward hook (with keyword
    arguments) of ``model``'s submodule at ``path``."""
    handles = [model.get_submodule(path).register_forward_hook(h, with_kwargs=True) for path, h in hooks]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
