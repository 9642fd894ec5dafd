"""``torch.export`` with the values the data decides taken from a real run (see
:func:`.trace.trace`): a forward that branches on a value of its data (``if mask.any().item():``,
a mixture's loop over the experts its router picked) is traced with each such value the one the
example inputs give it (``fake_tensor_propagate_real_tensors``, what ``torch.export.draft_export``
does, without its log files), each branch the one the example takes, asserted in the graph.

Each size the data decides (the rows ``nonzero`` returns, a boolean mask's selection) is
asserted equal to the example's once the op that computes it has run, so every later shape is
static: the program is of the example inputs, as :func:`.concrete.concretize` makes its sizes
anyway. torch (2.13) trips on its own checks in this mode otherwise, and each is worked around
here, never by changing what the program computes:

- a view of such a value along another axis (``nonzero(as_tuple=True)``, ``x[mask]``) has a
  storage offset that is a multiple of its size; torch's comparison of the fake value with the
  real one (``fake_utils._check_fake_real_tensors``) compares that offset although its caller
  asks it not to (``storage_offset=`` is never read), which fixes the size before the op that made
  it has bound it (``PendingUnbackedSymbolNotFound``): a symbolic offset is left out of that
  comparison (sizes and dtypes are still compared);
- iterating over a tensor of such a length (``for e in expert_hit``: the experts a router picked)
  unbinds it into one wrong piece while its length is symbolic: the assertion above makes it the
  example's;
- a one-element tensor formatted into a string (``self[f"expert_{idx}"]``: the module a loop
  calls) is formatted as its Python value, that value asserted in the graph;
- a parameter's real value is copied only where it is a plain ``Tensor``
  (``meta_utils._safe_copy``), so every ``nn.Parameter`` got uninitialised memory as its real
  value and a router's choice was taken from garbage (Switch Transformers: every token to
  expert 0, the other experts never read): a parameter's data is copied as any tensor's;
- an in-place ``index_add_`` (a mixture's experts added into their output, Switch
  Transformers) leaves its real value as it was before the op, so a later router chose from
  stale values and the program asserted sizes the example never has: it is run as
  ``index_add`` copied into place (``copy_``), the same values.

``run_decompositions`` of a program so made re-traces it with the same fake values, which carry
the real ones: :func:`real_values` is in place for that too.
"""
from __future__ import annotations

import contextlib
import logging

import torch

__all__ = ["export_real_values", "real_value_fixes", "real_values"]


def _offsets_unchecked(original):
    """``_check_fake_real_tensors`` leaving out a storage offset that is symbolic."""
    from torch.fx.experimental.symbolic_shapes import has_free_symbols

    def check(real_out, fake_out, context="", sizes=True, strides=False, storage_offset=True, requires_grad=True):
        if not requires_grad and has_free_symbols(fake_out.storage_offset()):
            torch._prims.utils.compare_tensor_meta(real_out, fake_out, check_sizes=sizes, check_strides=strides,
                                                   allow_rhs_unbacked=True)
            return None
        return original(real_out, fake_out, context=context, sizes=sizes, strides=strides,
                        storage_offset=storage_offset, requires_grad=requires_grad)
    return check


def _formatted(original):
    """``Tensor.__format__`` formatting a one-element tensor with a real value behind it as its
    Python value (``f"expert_{idx}"``: the module a loop calls), that value asserted in the graph."""
    def fmt(self, spec):
        real = getattr(self, "real_tensor", None)
        if self.dim() == 0 and isinstance(real, torch.Tensor):
            return format(type(real.item())(self.item()), spec)
        return original(self, spec)
    return fmt


def _specialised(original):
    """``compute_unbacked_bindings`` that, once an op has bound a size the data decides, asserts
    it equal to the example's value (a replacement: every later shape is static)."""
    import sympy

    def bindings(shape_env, example_value, old_example_value=None, peek=False):
        out = original(shape_env, example_value, old_example_value, peek)
        if out and not peek and shape_env is not None:
            for s in list(out):
                v = shape_env.real_tensor_prop_unbacked_vals.get(s)
                if v is not None:
                    shape_env.guard_or_defer_runtime_assert(sympy.Eq(s, v), "the example's value")
        return out
    return bindings


def _parameters_copied(original):
    """``meta_utils._safe_copy``/``_safe_clone`` taking an ``nn.Parameter`` as its data."""
    def copy(*args):
        *rest, src = args
        return original(*rest, src.data if isinstance(src, torch.nn.Parameter) else src)
    return copy


def _added_then_copied(original):
    """``Tensor.index_add_`` as ``index_add`` copied into place."""
    def index_add_(self, dim, index, source, *, alpha=1):
        return self.copy_(torch.index_add(self, dim, index, source, alpha=alpha))
    return index_add_


@contextlib.contextmanager
def real_value_fixes():
    """While inside, the workarounds of the module's docstring are in place."""
    from torch._subclasses import fake_utils, meta_utils
    from torch.fx.experimental import symbolic_shapes
    patches = [(meta_utils, "_safe_copy", _parameters_copied), (meta_utils, "_safe_clone", _parameters_copied),
               (fake_utils, "_check_fake_real_tensors", _offsets_unchecked),
               (symbolic_shapes, "compute_unbacked_bindings", _specialised),
               (torch.Tensor, "__format__", _formatted), (torch.Tensor, "index_add_", _added_then_copied)]
    saved = [(owner, name, getattr(owner, name), make) for owner, name, make in patches if hasattr(owner, name)]
    try:
        for owner, name, original, make in saved:
            setattr(owner, name, make(original))
        yield
    finally:
        for owner, name, original, _ in saved:
            setattr(owner, name, original)


@contextlib.contextmanager
def real_values():
    """While inside, ``torch.export`` (and ``run_decompositions`` of a program it so made, whose
    fake values still carry the real ones) takes the values the data decides from a real run,
    with the workarounds of the module's docstring in place."""
    shapes = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    level = shapes.level
    shapes.setLevel(logging.ERROR)  # one warning per specialised guard otherwise
    try:
        with torch._functorch.config.patch(fake_tensor_propagate_real_tensors=True,
                                           generate_fake_kernels_from_real_mismatches=True), real_value_fixes():
            yield
    finally:
        shapes.setLevel(level)


def export_real_values(model, traced, first):
    """``torch.export`` of ``model`` on ``traced`` (``(args, kwargs)``) with the values the data
    decides taken from a real run; ``first`` (the symbolic trace's failure) raised if that
    fails too."""
    try:
        with real_values():
            return torch.export.export(model, *traced, strict=False)
    except Exception:  # noqa: BLE001 - the guard is what the user must hear about
        raise first from None
