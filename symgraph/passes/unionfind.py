"""Union-find over axis variables, with duality parity, group kinds and structure.

Each axis ``a`` is ``root^p``: it transforms by its class element ``g`` when ``p = 0`` and by
``g^{-T}`` when ``p = 1``. A cycle that forces ``g = g^{-T}`` narrows the class to its
orthogonal part. A root may carry a structure: ``prod`` (the axis is the row-major flatten of
its parts) or ``sum`` (the concatenation of its parts); parts are ``(axis, parity)`` pairs.
Unifying two structured classes unifies their parts, refining when the cut points differ.
"""
from __future__ import annotations

import math

from ..core.groups import GroupKind, meet
from .rules.views import refine, refined_parts

__all__ = ['AxisUnionFind']


class AxisUnionFind:
    def __init__(self):
        self.parent: list[int] = []
        self.parity: list[int] = []
        self.size: list[int] = []
        self.kind: dict[int, GroupKind] = {}
        self.reasons: dict[int, list] = {}
        self.struct: dict[int, tuple] = {}
        self.pairs: dict[int, tuple] = {}
        self._pending: list = []

    # --- variables -----------------------------------------------------------------------
    def new(self, size: int) -> int:
        self.parent.append(len(self.parent))
        self.parity.append(0)
        self.size.append(int(size))
        return len(self.parent) - 1

    def find(self, a: int):
        path = []
        while self.parent[a] != a:
            path.append(a)
            a = self.parent[a]
        root = a
        # compress, accumulating parity from the top
        acc = 0
        for node in reversed(path):
            acc ^= self.parity[node]
            self.parent[node] = root
            self.parity[node] = acc
        return root, (self.parity[path[0]] if path else 0)

    def leaves(self, axis: int, par: int = 0) -> list:
        """``[(leaf root, parity)]`` of ``axis``: itself, or its structure's parts' leaves, in
        order (a walk, not a recursion: a structure may nest as deep as a time axis is long)."""
        out, todo = [], [(axis, par)]
        while todo:
            a, pa = todo.pop()
            r, p = self.find(a)
            p ^= pa
            if r in self.struct:
                todo.extend((b, pb ^ p) for b, pb in reversed(self.struct[r][1]))
            else:
                out.append((r, p))
        return out

    def part_sizes(self, r: int) -> list:
        """The sizes of the parts of the structured class ``r``, in order."""
        return [self.size[self.find(a)[0]] for a, _ in self.struct[r][1]]

    def fold(self, axis: int, leaf, combine, par: int = 0, expand=None, memo: dict | None = None):
        """A value of ``axis`` computed from its structure bottom up, by a walk rather than a
        recursion (a sum may nest as deep as a time axis is long: ``x[1:]`` beside ``x[:-1]``).
        ``leaf(root, parity)`` gives a leaf's value, and a structured class's where
        ``expand(kind)`` says not to descend; ``combine(root, parity, kind, values)`` a
        structure's from its parts' values, in order. Parities accumulate as :meth:`find`
        gives them. ``memo`` (``{root: value}``, for values that do not depend on parity) is
        read and filled on the way."""
        stack, values = [(axis, par, False)], []
        while stack:
            a, pa, ready = stack.pop()
            r, p = self.find(a)
            p ^= pa
            s = self.struct.get(r)
            if memo is not None and r in memo:
                values.append(memo[r])
                continue
            if s is None or (expand is not None and not expand(s[0])):
                v = leaf(r, p)
            elif not ready:
                stack.append((a, pa, True))
                stack.extend((c, pc ^ p, False) for c, pc in reversed(s[1]))
                continue
            else:
                k = len(s[1])
                v = combine(r, p, s[0], values[len(values) - k:])
                del values[len(values) - k:]
            if memo is not None:
                memo[r] = v
            values.append(v)
        return values[0]

    # --- constraints ---------------------------------------------------------------------
    def meet(self, a: int, kind: GroupKind, reason: str | None = None):
        r, _ = self.find(a)
        old: GroupKind = self.kind.get(r, "gl")
        new = meet(old, kind)
        if new != old:
            self.kind[r] = new
            if reason:
                self.reasons.setdefault(r, []).append((new, reason))

    def set_pairs(self, a: int, pairs, reason: str):
        r, _ = self.find(a)
        pairs = tuple(sorted(tuple(sorted(p)) for p in pairs))
        if r in self.pairs and self.pairs[r] != pairs:
            self.meet(r, "identity", reason + " (conflicting rotary pairs)")
        self.pairs[r] = pairs
        self.meet(r, "rope", reason)

    def union(self, a: int, b: int, dual: bool = False):
        self._pending.append((a, b, int(dual)))
        self._drain()

    def add_structure(self, a: int, kind: str, parts):
        parts = tuple((p, 0) if isinstance(p, int) else p for p in parts)
        if kind == "prod":  # size-1 factors carry nothing; size-1 segments do
            parts = tuple(p for p in parts if self.size[p[0]] != 1)
        if len(parts) == 0:
            return
        if len(parts) == 1:
            self.union(a, parts[0][0], bool(parts[0][1]))
            return
        r, pr = self.find(a)
        parts = tuple((p, par ^ pr) for p, par in parts)
        self._merge_structure(r, (kind, parts))
        self._drain()

    # --- internals -----------------------------------------------------------------------
    def _drain(self):
        """Settle the queued unions and structure merges. A merge queues its parts' merges
        rather than recursing: a time axis cut one sample apart twice (a convolution's shifted
        slices) refines over as many levels as it has samples."""
        while self._pending:
            item = self._pending.pop()
            if item[0] == "struct":
                _, a, (kind, parts) = item
                r, pr = self.find(a)
                self._merge_structure(r, (kind, tuple((p, par ^ pr) for p, par in parts)))
            else:
                self._union1(*item)

    def _union1(self, a, b, dual):
        ra, pa = self.find(a)
        rb, pb = self.find(b)
        if ra == rb:
            if pa ^ pb != dual:
                self.meet(ra, "orthogonal", "axis paired with its own dual")
            return
        if self.size[ra] != self.size[rb]:
            raise AssertionError(f"rule bug: unify axes of sizes {self.size[ra]} and {self.size[rb]}")
        q = pa ^ dual ^ pb  # rb = ra^q
        self.parent[rb] = ra
        self.parity[rb] = q
        kb = self.kind.pop(rb, "gl")
        reasons_b = self.reasons.pop(rb, [])
        self.reasons.setdefault(ra, []).extend(reasons_b)
        if not self.reasons[ra]:
            del self.reasons[ra]
        self.meet(ra, kb)
        if rb in self.pairs:
            pairs = self.pairs.pop(rb)
            if ra in self.pairs and self.pairs[ra] != pairs:
                self.meet(ra, "identity", "conflicting rotary pairs")
            self.pairs[ra] = pairs
        sb = self.struct.pop(rb, None)
        if sb is not None:
            kind, parts = sb
            self._merge_structure(ra, (kind, tuple((p, par ^ q) for p, par in parts)))

    def _merge_structure(self, r, new):
        old = self.struct.get(r)
        if old is None:
            self.struct[r] = new
            return
        (k1, p1), (k2, p2) = old, new
        s1 = [self.size[p] for p, _ in p1]
        s2 = [self.size[p] for p, _ in p2]
        if k1 == k2 and s1 == s2:
            for (x, px), (y, py) in zip(p1, p2):
                self._pending.append((x, y, px ^ py))
            return
        if k1 == k2 == "prod":
            ref = refine(s1, s2)
        elif k1 == k2 == "sum":
            ref = _refine_sum(s1, s2)
        else:
            ref = None
            ordered = (p1, p2) if k1 == "prod" else (p2, p1)
            if self._sum_of_blocks(*ordered) or (r not in self.pairs and self._cut_blocks(r, *ordered)):
                return
        if ref is None:
            why = f"incompatible structures {k1}{s1} and {k2}{s2}"
            self.meet(r, "identity", why)
            # the parts of both are fixed too: other axes (a view's output, a grouped
            # convolution's other side) share them, and must not move without this one
            for p, _ in p1 + p2:
                self.meet(p, "identity", why)
            return
        atoms, made = refined_parts(ref, (p1, p2), self.new)
        for (p, par), of in made:
            if len(of) == 1:
                self._pending.append((p, of[0], par))
            else:
                self._pending.append(("struct", p, (k1, tuple((a, par) for a in of))))
        self.struct[r] = (k1, tuple((a, 0) for a in atoms))

    def _sum_of_blocks(self, prod_parts, sum_parts) -> bool:
        """An axis that is both ``prod(P0, P1, ..., Pk)`` and a concatenation ``sum(Q1, ...)``
        cut at multiples of the inner block ``M = |P1|...|Pk|`` (ZAYA concatenates its query
        and key heads, then convolves them in groups of one head): P0 is the concatenation of
        ``|Qi| / M`` rows per part, and each Qi is ``prod(its rows, P1, ..., Pk)``, every part
        sharing the inner factors. ``kron(blockdiag(c_i), g) = blockdiag(kron(c_i, g))``, so
        this keeps both descriptions. False (nothing done) when a cut falls inside a block."""
        sizes = [self.size[p] for p, _ in prod_parts]
        inner = math.prod(sizes[1:])
        if len(prod_parts) < 2 or inner <= 1 or any(self.size[q] % inner or not self.size[q]
                                                     for q, _ in sum_parts):
            return False
        (a0, q0), rest = prod_parts[0], list(prod_parts[1:])
        rows = [self.new(self.size[q] // inner) for q, _ in sum_parts]
        r0, p0 = self.find(a0)
        self._merge_structure(r0, ("sum", tuple((c, q0 ^ p0) for c in rows)))
        for (q, qpar), c in zip(sum_parts, rows):
            rq, pq = self.find(q)
            parts = ([(c, 0)] if self.size[c] > 1 else []) + rest
            if len(parts) == 1:
                self._pending.append((q, parts[0][0], qpar ^ parts[0][1]))
            else:
                self._merge_structure(rq, ("prod", tuple((a, par ^ qpar ^ pq) for a, par in parts)))
        return True

    def _cut_blocks(self, r, prod_parts, sum_parts) -> bool:
        """An axis that is both ``prod(B, C)`` (``|B|`` blocks of ``|C|``: GroupNorm's groups)
        and a concatenation cut inside a block (a UNet's skip connection joined to its up path,
        then normalised in groups that straddle the join): the blocks stay in place (``B``
        fixed) and ``C`` is cut at every concatenation cut's offset inside its block, so one
        element of ``C``'s segments, repeated in every block, keeps both descriptions
        (``kron(I, blockdiag(s)) = blockdiag(s, ..., s)``). False (nothing done) for a product
        of more than two parts."""
        if len(prod_parts) != 2:
            return False
        (b, _), (c, cpar) = prod_parts
        inner, blocks = self.size[c], self.size[b]
        offsets = sorted({x % inner for x in _cuts([self.size[q] for q, _ in sum_parts])} | {0, inner})
        atoms = [self.new(hi - lo) for lo, hi in zip(offsets, offsets[1:])]
        self.meet(b, "identity", f"blocks of {inner} straddle the cuts of a concatenation")
        rc, pc = self.find(c)
        self._merge_structure(rc, ("sum", tuple((a, cpar ^ pc) for a in atoms)))
        self.struct[r] = ("sum", tuple((a, 0) for _ in range(blocks) for a in atoms))
        self._merge_structure(r, ("sum", tuple(sum_parts)))
        return True


def _refine_sum(s1, s2):
    """Common refinement of two segmentations of one axis: cut at every cut point of either."""
    if sum(s1) != sum(s2):
        return None
    cuts = sorted(set(_cuts(s1)) | set(_cuts(s2)))
    sizes = [b - a for a, b in zip(cuts, cuts[1:])]
    def owners(s):
        out, start = [], 0
        for n in s:
            out.append([i for i, (a, b) in enumerate(zip(cuts, cuts[1:])) if a >= start and b <= start + n])
            start += n
        return out
    return sizes, owners(s1), owners(s2)


def _cuts(sizes):
    out, acc = [0], 0
    for s in sizes:
        acc += s
        out.append(acc)
    return out


def prod(xs):
    return math.prod(xs)
