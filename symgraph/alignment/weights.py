"""Similarity of a class from the weights (data-free): Git Re-Basin's weight matching
generalised to rotations and head-structured classes, as a sum of per-slot contributions."""
from __future__ import annotations

from typing import Callable

import torch

from ..core.elements import Blocks, apply_along
from ..core.gemm import matmul
from .products import HALF, cross, cross_by_columns, gather, sliced
from .sums import add_into, frobenius, plus_bound, settled  # noqa: F401 (frobenius: re-exported)
from ..core.groups import PERMUTATION_FAMILY, orthogonal_part

__all__ = ["WeightFeatures", "gather", "cross", "circuit_scores"]


class WeightFeatures:
    """Similarity of a class from the weights, as a sum of per-slot contributions.

    A slot's contribution depends on the elements of the classes on the parameter's other
    axes (its *dependencies*); contributions are cached with the versions of those elements
    and recomputed only when one of them changed. Weights stay in their own dtype (no float64
    copies of either model): permutation classes rank in that dtype, continuous classes gather
    their (small) slices into float64 so that Procrustes is exact.
    """

    CACHE_NUMEL = 1 << 20  # contributions larger than this (e.g. MLP×MLP) are not kept
    POOL_BYTES = 512 << 20  # pooled contributions of discrete dependencies kept (see _poolable)
    AXIS_MAP_NUMEL = 1 << 24  # B's maps kept up to this size (a residual stream's rotation at d = 4096)
    MAPPED_KEPT = 4  # B's mapped slices of :attr:`mapped_once` kept (a head family reads two, twice)

    def __init__(self, ra, rb, tensors_a, tensors_b, exact_dtype=torch.float64, products="exact", sketch=0,
                 rows=None, block_scale="none", head_cost="procrustes", bounds=False):
        """``tensors_a`` / ``tensors_b``: ``{parameter name: tensor}`` of the two models with
        the reports' norm gains folded (any ``Mapping``; :mod:`symgraph.merging.streaming` passes lazy
        ones that read a checkpoint on demand). ``exact_dtype``: what continuous classes
        (rotations) gather their slices in; float32 is ample for 16-bit weights.
        ``products``: "exact" (permutation classes in the weights' own dtype, rotations in
        ``exact_dtype``; contributions summed in at least float32) or "bf16" (every product in
        bfloat16: the CPU kernels accumulate in float32 but round each result to bfloat16, as
        no CPU kernel writes a float32 result from bfloat16 inputs). ``sketch``: k > 0 compares a permutation
        class's rows through a shared random projection of k columns (Johnson–Lindenstrauss:
        ``S ≈ (X_A Ω)(X_B M_Bᵀ Ω)ᵀ``, B's map applied to Ω rather than to its weights) where a
        matrix's other axis is wider than 2k; 0 computes S exactly. ``rows``: ``{parameter:
        row indices}``: those parameters' slots read only these rows of their first axis (an
        axis no class acts on), e.g. the token embeddings of tokens seen in the data
        (``SymmetryReport.input_rows``; Theus et al. 2025 match on those only). ``block_scale``:
        "columns" divides each slot of a rotation class (one not fibred over heads) by its
        number of columns (Theus et al. 2025's 1/√columns on both sides); "none" sums them as
        they are. ``head_cost``: "circuits" also scores each head pair of a ``gl`` class (QK,
        VO) by the distance of their circuits ``‖X_Aᵀ Y_A − X_B′ᵀ Y_B′‖`` (co slots X, contra
        slots Y: ``W_Qᵀ W_K``, ``W_O W_V``; invariant under the whole GL(d_k) per head, Theus et
        al. 2025's head cost), relative to A's mean circuit norm, in :attr:`head_scores`."""
        self.ra, self.rb, self.exact_dtype, self.products = ra, rb, exact_dtype, products
        self.sketch, self._omega = int(sketch), {}
        self.rows = dict(rows or {})
        self.block_scale, self.head_cost = block_scale, head_cost
        self.head_scores: dict = {}  # group id -> [H_A, H_B] circuit scores of the last similarity
        # ``bounds``: group id -> the Cauchy–Schwarz bound on ``<element, S>`` of its last
        # similarity (None: unknown, e.g. sketched), for the solve loop's ``until="gap"``, which
        # turns it on; None: not computed (a norm of B's slice per slot saved)
        self.bounds: dict | None = {} if bounds else None
        self.A, self.B = tensors_a, tensors_b
        self._cache: dict = {}
        self._pool: dict = {}  # (group id, deps, cross) -> (versions, summed contributions)
        self._pool_bytes, self._kinds = 0, None
        self._deps: dict = {}
        # B's group id -> B's classes nested under it in its solve unit (set by the solve loop
        # before any similarity): its views holding one of them are left to that class
        self.nested: dict = {}
        # (parameter, dim) whose B slice, its other axes mapped, a unit's rotation classes and
        # its permutation classes both read (set by the solve loop: :meth:`share_maps`); the
        # dense maps are applied once, in the exact dtype, and kept a while (:attr:`_mapped`)
        self.mapped_once: set = set()
        self._mapped: dict = {}  # (parameter, dim) -> (the maps applied, B's mapped tensor)
        self._axis_memo: dict = {}  # (axis key, which of its classes have elements) -> (versions, map)
        self._numel: dict = {}
        self._norms: dict = {}  # (group id, parameter, dim, view) -> the norm of A's slice
        self.versions: dict = {}  # shared with the solve loop: group id -> changes so far
        # set by .shared while all processes compute one similarity: ``share([(key, cost,
        # compute)])[key] -> value`` computes a share of the slots here and gathers the rest
        self.share: Callable | None = None

    def release(self) -> None:
        """Drop the tensors and everything computed from them. The solve loop holds this object
        in reference cycles (its similarity closures), which keep it, and a whole model's folded
        copies, until Python's cycle collector runs: on a GPU, through the merge that follows."""
        self.A = self.B = None
        for d in (self._cache, self._pool, self._axis_memo, self._omega, self._norms, self._mapped):
            d.clear()
        self._pool_bytes = 0

    @classmethod
    def from_models(cls, ra, rb, model_a, model_b, **options):
        return cls(ra, rb, _folded(ra, {k: model_a.get_parameter(k).detach() for k in ra.parameters}),
                   _folded(rb, {k: model_b.get_parameter(k).detach() for k in rb.parameters}), **options)

    def _axis_op(self, a, elements):
        """B's current map on axis ``a``: an index vector for a permutation, :class:`Blocks`
        for a head axis whose map moves whole heads, else the dense matrix; memoised by the
        versions of the axis' leaf classes. One map per axis (and which of its classes have an
        element): versions only grow, so a map of older versions is never asked for again, and
        kept it would stay for the whole solve (a head axis' 1 MB map of every sweep and every
        round of the full-group fit: 0.8 GB at the 1.1B shape's 16 rounds). Maps up to
        :attr:`AXIS_MAP_NUMEL` are kept: the residual stream's rotation is asked for by every
        slot of every layer, and was built anew each time."""
        rb = self.rb
        now = tuple((g in elements, self.versions.get(g, 0)) for g in rb.axis_groups(a))
        key = (rb.axis_key(a), tuple(has for has, _ in now))
        hit = self._axis_memo.get(key)
        if hit is not None and hit[0] == now:
            return hit[1]
        M = rb.axis_map(a, elements, blocks=True)
        if M is None or M.dim() == 1 or M.numel() <= self.AXIS_MAP_NUMEL:
            self._axis_memo[key] = (now, M)
        else:
            self._axis_memo.pop(key, None)  # an older version's map
        return M

    def slots(self, ga):
        return list(dict.fromkeys(ga.params))

    def share_maps(self, groups) -> None:
        """Note the slots that rotation classes and permutation classes of one solve unit
        (``groups``: a head family's members) both read: a query projection's head
        permutation and its RoPE rotations, an output projection's head permutation and its
        per-head GL. B's slice, with the residual stream's rotation applied, is then computed
        once in the exact dtype; the permutation class ranks its rounding to the weights'
        dtype (rather than a product with the rotation rounded to it first)."""
        if self.products == "bf16":
            return
        exact: set = set()
        ranked: set = set()
        for g in groups:
            (ranked if orthogonal_part(g.kind) in ("perm", "signed_perm") else exact).update(self.slots(g))
        self.mapped_once |= exact & ranked

    def _mapped_b(self, name, d, tb, maps, exact, stored):
        """B's slice ``tb`` with ``maps`` (``[(dim, map)]``: its axes other than ``d``) applied:
        in its dtype, or for a slot of :attr:`mapped_once` of 16-bit weights (``stored``: their
        dtype) in the exact dtype (kept for the unit's other classes; a permutation class gets
        it rounded back to the weights' dtype)."""
        if not maps or (name, d) not in self.mapped_once or stored not in HALF:
            return _applied(tb, maps)
        hit = self._mapped.get((name, d))
        if hit is not None and [k for k, _ in hit[0]] == [k for k, _ in maps] and all(
                M is M2 for (_, M), (_, M2) in zip(maps, hit[0])):  # the maps _axis_op kept
            out = hit[1]
        else:
            out = _applied(tb.to(self.exact_dtype), maps)
            self._mapped.pop((name, d), None)
            while len(self._mapped) >= self.MAPPED_KEPT:
                self._mapped.pop(next(iter(self._mapped)))
            self._mapped[(name, d)] = (maps, out)
        return out if exact else out.to(tb.dtype)

    def deps(self, gb, name, d):
        """B's leaf classes (other than ``gb`` and its fibres) that the slot's feature uses."""
        key = (gb.id, name, d)
        if key not in self._deps:
            rb = self.rb
            ax = rb.param_axes(name)
            out = set()
            for k, a in enumerate(ax):
                if k != d:
                    out.update(rb.axis_groups(a))
            fib = set(gb.outer) | self.nested.get(gb.id, frozenset())
            out.update(x for x in rb.axis_groups(ax[d]) if x != gb.id and x not in fib)
            self._deps[key] = frozenset(out)
        return self._deps[key]

    def similarity(self, ga, gb, elements, cross_fibres: bool, usable=None):
        """``(S, complete, deps)``: ``S [*F_A, *F_B, n_A, n_B]`` (cross_fibres) summed over the
        slots whose dependencies are ``usable`` (all by default); ``complete`` is False when a
        slot was left out; ``deps`` are the classes the used slots depend on."""
        versions = self.versions
        exact = orthogonal_part(ga.kind) not in ("perm", "signed_perm")
        total, na2, nb2, complete, used, bound = None, 0.0, 0.0, True, set(), 0.0  # total: see add_into
        circ = self.head_cost == "circuits" and cross_fibres and ga.kind == "gl"
        parts = None  # circuits: [S per parity, A's Grams per parity, B's Grams per parity]
        self.head_scores.pop(ga.id, None)
        hits: set = set()
        fresh: dict = {}  # pools read whole; pool -> [versions, sum of its slots, complete]
        shared = None if self.share is None else self.share(
            [(key, cost, lambda name=name, d=d: self._slot(ga, gb, name, d, elements, cross_fibres, exact, circ))
             for key, name, d, cost in self._misses(ga, gb, cross_fibres, usable)])
        for name, d in self.slots(ga):
            dep = self.deps(gb, name, d)
            if usable is not None and not usable(dep):
                complete = False
                continue
            key = (ga.id, name, d, cross_fibres)
            ver = tuple(sorted((r, versions.get(r, 0)) for r in dep))
            pool = (ga.id, dep, cross_fibres) if self._poolable(dep, cross_fibres, circ) else None
            if pool is not None:
                hit = self._pool.get(pool)
                if hit is not None and hit[0] == ver:  # the whole pool's sum, once
                    if pool not in hits:
                        hits.add(pool)
                        used |= dep
                        total = add_into(total, hit[1])
                        bound = plus_bound(bound, hit[2])
                    continue
            s, a2, b2, partial, cp, fro = self._slot_value(
                key, ver, dep, shared, lambda: self._slot(ga, gb, name, d, elements, cross_fibres, exact, circ))
            complete &= not partial
            if s is None:
                if pool is not None:
                    fresh.setdefault(pool, [ver, None, True, 0.0])[2] &= not partial
                continue
            if circ and cp is not None:
                for k in (0, 1):
                    parts = _add_parity(parts, k, [p[k] for p in cp])
            used |= dep
            total = add_into(total, s)
            na2, nb2, bound = na2 + a2, nb2 + b2, plus_bound(bound, fro)
            if pool is not None:
                got = fresh.setdefault(pool, [ver, None, True, 0.0])
                got[1], got[2], got[3] = add_into(got[1], s), got[2] and not partial, plus_bound(got[3], fro)
        self._keep_pools(fresh)
        total = self._finished(ga, settled(total), na2, nb2, bound, parts if circ else None)
        return total, complete, frozenset(used)

    def _slot_value(self, key, ver, dep, shared, compute):
        """A slot's contribution: cached with the present versions, else computed (``compute``,
        or by one of the processes: ``shared``, see .shared) and kept when small, or when it
        reads no other class (fixed for the whole solve: the embeddings' and head's Grams of a
        residual stream)."""
        hit = self._cache.get(key)
        if hit is not None and hit[0] == ver:
            return hit[1]
        val = compute() if shared is None else shared[key]
        if val[0] is not None and (val[0].numel() <= self.CACHE_NUMEL or not dep) and not val[3]:
            self._cache[key] = (ver, val)
        return val

    def _finished(self, ga, total, na2, nb2, bound, parts):
        """The summed similarity: circuit scores kept from ``parts`` (circuits: both sides
        seen), scaled per head pair by the features' norms, its bound noted."""
        if parts is not None and total is not None and total.dim() == 4 and all(
                isinstance(x, torch.Tensor) for p in parts for x in p):  # both sides of the circuit seen
            self.head_scores[ga.id] = circuit_scores(*(torch.stack(p) for p in parts))
        if total is not None and total.dim() == 4:
            # per head pair, scale by the features' norms: the matching pair then scores
            # exactly 1 per class and every other pair at most 1 (Cauchy-Schwarz)
            total = total / (torch.as_tensor(na2).clamp_min(1e-30).sqrt()[:, None, None, None]
                             * torch.as_tensor(nb2).clamp_min(1e-30).sqrt()[None, :, None, None])
            bound = float(total.shape[1])  # each B fibre's matched pair scores at most 1
        if self.bounds is not None:
            self.bounds[ga.id] = bound
        return total

    def _misses(self, ga, gb, cross_fibres, usable):
        """``[(cache key, name, dim, cost)]``: the slots :meth:`similarity` computes (neither
        pooled nor cached with the present versions), cost by B's parameter size."""
        out = []
        circ = self.head_cost == "circuits" and cross_fibres and ga.kind == "gl"
        for name, d in self.slots(ga):
            dep = self.deps(gb, name, d)
            if usable is not None and not usable(dep):
                continue
            ver = tuple(sorted((r, self.versions.get(r, 0)) for r in dep))
            if self._poolable(dep, cross_fibres, circ):
                hit = self._pool.get((ga.id, dep, cross_fibres))
                if hit is not None and hit[0] == ver:
                    continue
            key = (ga.id, name, d, cross_fibres)
            hit = self._cache.get(key)
            if hit is None or hit[0] != ver:
                out.append((key, name, d, self.numel(name)))
        return out

    def numel(self, name) -> int:
        """B's parameter ``name``'s size (memoised: a lazy mapping reads it once)."""
        if name not in self._numel:
            self._numel[name] = self.B[name].numel()
        return self._numel[name]

    def _poolable(self, dep, cross_fibres, circ) -> bool:
        """Whether a slot's contribution is summed with the others of the same dependencies and
        kept (up to :attr:`POOL_BYTES`): a class not fibred over heads (a residual stream),
        whose slot reads only discrete classes (permutations: an MLP's, which stop changing
        after a sweep or two, while rotations move a little every sweep). The residual
        stream's MLP slots are most of its similarity; kept, a sweep recomputes only the slots
        that read the heads' rotations."""
        if cross_fibres or circ or not dep:
            return False
        if self._kinds is None:
            self._kinds = {g.id: g.kind for g in self.rb.groups}
        return all(orthogonal_part(self._kinds.get(g, "")) in PERMUTATION_FAMILY for g in dep)

    def _keep_pools(self, fresh):
        """Keep the pools computed in this call whose every slot took part, within the budget."""
        for pool, (ver, total, complete, fro) in fresh.items():
            total = settled(total)
            if not complete or not isinstance(total, torch.Tensor):
                continue  # left a slot out, or nothing came of it: not kept
            old = self._pool.pop(pool, None)
            if old is not None:
                self._pool_bytes -= old[1].numel() * old[1].element_size()
            size = total.numel() * total.element_size()
            if self._pool_bytes + size <= self.POOL_BYTES:
                self._pool[pool] = (ver, total, fro)
                self._pool_bytes += size

    def _views(self, ga, gb, axis_a, axis_b, elements, circ):
        """The slot's views of the class in A and B, the parity of each (circuits), and B's
        elements of the other leaves in each; a view read by a class nested under ``gb`` is
        left to that class."""
        va, vb = self.ra.leaf_views(axis_a, ga.id), self.rb.leaf_views(axis_b, gb.id)
        parity = [k for *_, k in self.ra.leaf_views(axis_a, ga.id, with_parity=True)] if circ else []
        others = self.rb.other_leaf_elements(axis_b, gb.id, elements) if va else []  # per view
        if self.nested.get(gb.id) and va:  # views read by a class nested under this one: its own
            keep = [v for v, o in enumerate(self.rb.other_leaf_groups(axis_b, gb.id))
                    if not self.nested[gb.id] & set(o)]
            va, vb, others = [va[v] for v in keep], [vb[v] for v in keep], [others[v] for v in keep]
            parity = [parity[v] for v in keep] if parity else parity
        return va, vb, parity, others

    def _slot(self, ga, gb, name, d, elements, cross_fibres, exact, circ=False):
        ax_a, ax_b = self.ra.param_axes(name), self.rb.param_axes(name)
        total, a2, b2, parts, fro = None, 0.0, 0.0, None, 0.0
        va, vb, parity, others = self._views(ga, gb, ax_a[d], ax_b[d], elements, circ)
        ta, tb = self.ra.view(name, self.A[name]), self.rb.view(name, self.B[name])
        r = self.rows.get(name)
        if r is not None and d != 0 and ta.dim() == len(ax_a) and not self.rb.axis_groups(ax_b[0]):
            ta, tb = ta.index_select(0, r.to(ta.device)), tb.index_select(0, r.to(tb.device))
        stored = tb.dtype
        acc = self.exact_dtype if exact else torch.promote_types(
            torch.promote_types(ta.dtype, tb.dtype), torch.float32)  # what contributions sum in
        maps = [(k, M) for k, a in enumerate(ax_b) if k != d and (M := self._axis_op(a, elements)) is not None]
        late = (exact and self.products != "bf16" and not circ and not maps
                and sliced(ta, tb, self.exact_dtype, va, others))
        if self.products == "bf16":
            ta, tb = ta.to(torch.bfloat16), tb.to(torch.bfloat16)
        elif exact and not late:
            ta, tb = ta.to(self.exact_dtype), tb.to(self.exact_dtype)
        elif ta.dtype != tb.dtype or ta.dtype == torch.float16:  # different dtypes: a common one; float16:
            ta, tb = ta.to(acc), tb.to(acc)  # float32, as its products overflow at 65504 (bfloat16's do not)
        if (self.sketch and not exact and ta.dim() == 2 and len(va) == 1 and va[0][1] == 0 and others == [[]]
                and ta.shape[1 - d] > 2 * self.sketch):
            return self._sketched(ta, tb, d, ax_b[1 - d], va[0][0], vb[0][0], elements, acc)
        tb = self._mapped_b(name, d, tb, maps, exact, stored)  # other dims into A's basis
        if others and all(o is None for o in others):  # no view's other leaves are solved yet
            return None, a2, b2, True, None, 0.0
        partial = any(o is None for o in others)
        for v, ((ia, fa), (ib, fb)) in enumerate(zip(va, vb)):
            if others[v] is None:  # this view's other leaves are not solved yet, another view's
                others[v] = []     # are (a fused QKV's keys): B's order for it, re-solved later
            xa = gather(ta, d, ia, fa)  # [*F, n, m]
            xb = gather(tb, d, ib, fb, others[v])
            if xa.shape[-1] != xb.shape[-1]:
                continue
            s = cross_by_columns(xa, xb, acc) if late else cross(xa, xb, fa, cross_fibres)
            if fa or parity or len(va) > 1 or exact:  # (else the caller sums it in float32: add_into)
                s = s.to(acc)
            if parity and fa:  # [S, A's Gram, B's Gram] x [co, contra]
                fla, flb = (x.reshape(-1, *x.shape[fa:]).to(acc) for x in (xa, xb))
                parts = _add_parity(parts, parity[v], (s, fla @ fla.mT, flb @ flb.mT))
            # Cauchy–Schwarz: <E, xa xbᵀ> <= ‖xa‖ ‖xb‖ for an orthogonal or permutation E (A's
            # side is never transformed: its norm is read once)
            f = 0.0
            if self.bounds is not None and not (fa and cross_fibres):  # (per head pair, the norms below bound it)
                na = self._norms.get((ga.id, name, d, v))
                if na is None:
                    na = self._norms[(ga.id, name, d, v)] = frobenius(xa)
                f = na * frobenius(xb)
            if exact and fa == 0 and self.block_scale == "columns":
                s, f = s / xa.shape[-1], f / xa.shape[-1]
            total = s if total is None else total + s
            fro += f
            if fa and cross_fibres:
                a2 = a2 + (xa.reshape(-1, *xa.shape[fa:]).to(acc) ** 2).sum((-1, -2))
                b2 = b2 + (xb.reshape(-1, *xb.shape[fb:]).to(acc) ** 2).sum((-1, -2))
        return total, a2, b2, partial, parts, fro


    def _sketched(self, ta, tb, d, axis_b, ia, ib, elements, acc):
        """A matrix slot's contribution through the shared projection ``Ω [m, k]``: A's rows
        times Ω, B's rows times ``M_Bᵀ Ω`` (its other axis' map moved onto Ω: k·m² instead of
        n·m² for a dense map, a gather of Ω for a permutation)."""
        m = ta.shape[1 - d]
        key = (m, self.sketch, ta.dtype, ta.device)
        if key not in self._omega:
            g = torch.Generator().manual_seed(m * 7919 + self.sketch)
            self._omega[key] = (torch.randn(m, self.sketch, generator=g) / self.sketch ** 0.5).to(ta.device, ta.dtype)
        om = self._omega[key]
        M = self._axis_op(axis_b, elements)
        if M is None:
            om_b = om
        elif M.dim() == 1:  # B's coordinate M[i] goes to A's i: Ω's row i moves to M[i]
            om_b = torch.empty_like(om)
            om_b[M.to(om.device)] = om
        else:
            om_b = matmul((M.dense() if isinstance(M, Blocks) else M).to(om.device, om.dtype).mT, om)
        xa = matmul(ta.movedim(d, 0)[ia.reshape(-1).to(ta.device)], om)
        xb = matmul(tb.movedim(d, 0)[ib.reshape(-1).to(tb.device)], om_b)
        return matmul(xa, xb.mT).to(acc), 0.0, 0.0, False, None, None  # a projection: no bound


def _applied(t, maps):
    """``t`` with each ``(dim, map)`` of ``maps`` applied in turn."""
    for k, M in maps:
        t = apply_along(t, k, M)
    return t


def _add_parity(parts, k, values):
    """``parts`` ([S, GA, GB] x [co, contra], 0 where nothing yet) with ``values`` added on side ``k``."""
    parts = parts or [[0, 0], [0, 0], [0, 0]]
    for p, x in zip(parts, values):
        p[k] = p[k] + x
    return parts


def circuit_scores(S, GA, GB):
    """``-‖C_A,i − C_B,j‖ / mean_i ‖C_A,i‖`` for every head pair, from the co (0) and contra (1)
    parts: ``S [2, H_A, H_B, n, n]`` (``X_A X_B′ᵀ``), ``GA [2, H_A, n, n]``, ``GB [2, H_B, n, n]``
    (each model's own Grams). With ``C = Xᵀ Y``: ``<C_A, C_B> = Σ (X_A X_Bᵀ) ⊙ (Y_A Y_Bᵀ)``."""
    dot = (S[0] * S[1]).sum((-1, -2))
    na = (GA[0] * GA[1]).sum((-1, -2))
    nb = (GB[0] * GB[1]).sum((-1, -2))
    dist = (na[:, None] + nb[None, :] - 2 * dot).clamp_min(0).sqrt()
    return -dist / na.clamp_min(0).sqrt().mean().clamp_min(1e-30)


def _folded(report, tensors):
    """The weights with norm gains folded into their readers (what the classes act on)."""
    return tensors | {k: v.to(tensors[k].dtype) for k, v in report.fold(tensors).items()}
