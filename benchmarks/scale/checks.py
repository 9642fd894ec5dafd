"""Checks of merge outputs: tensor names/shapes/dtypes from the headers, a full
``from_pretrained``, and the streamed comparison of symgraph's output with mergekit's."""
from __future__ import annotations

import time
from pathlib import Path

from .checkpoints import tensor_files


def check_output(out, ref, load_check: bool) -> dict:
    """Names, shapes and dtypes of ``out``'s tensors against the input ``ref`` (headers only);
    with ``load_check``, a full ``from_pretrained``."""
    from safetensors import safe_open
    res = {"ok": False}
    try:
        files, ref_files = tensor_files(out), tensor_files(ref)
    except Exception as e:  # noqa: BLE001 - recorded, not raised
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}
    res["index"] = (Path(out) / "model.safetensors.index.json").exists()
    res["missing"] = sorted(set(ref_files) - set(files))[:10]
    res["unexpected"] = sorted(set(files) - set(ref_files))[:10]
    bad_dtype, bad_shape, absent = [], [], []
    handles = {}
    try:
        for k, f in files.items():
            if f not in handles:
                handles[f] = safe_open(str(f), framework="pt")
            h = handles[f]
            if k not in h.keys():
                absent.append(k)
                continue
            sl = h.get_slice(k)
            if sl.get_dtype() != "BF16":
                bad_dtype.append(f"{k}:{sl.get_dtype()}")
            if k in ref_files:
                with safe_open(str(ref_files[k]), framework="pt") as r:
                    if list(r.get_slice(k).get_shape()) != list(sl.get_shape()):
                        bad_shape.append(k)
    finally:
        handles.clear()
    res.update(not_in_file=absent[:10], non_bf16=bad_dtype[:10], shape_mismatch=bad_shape[:10],
               tensors=len(files))
    res["ok"] = not (res["missing"] or res["unexpected"] or absent or bad_dtype or bad_shape)
    if load_check:
        res["from_pretrained"] = load_check_dir(out)
        res["ok"] = res["ok"] and res["from_pretrained"]["ok"]
    return res


def load_check_dir(path) -> dict:
    """``AutoModelForCausalLM.from_pretrained(path)``: every key loaded, every parameter bf16."""
    import torch
    from transformers import AutoModelForCausalLM
    try:
        model, info = AutoModelForCausalLM.from_pretrained(str(path), output_loading_info=True)
    except Exception as e:  # noqa: BLE001 - recorded, not raised
        return {"ok": False, "error": f"{type(e).__name__}: {e}"[:500]}
    dtypes = sorted({str(p.dtype) for p in model.parameters()})
    info = {k: sorted(map(str, v))[:10] for k, v in info.items() if k != "error_msgs"}
    ok = not any(info.values()) and dtypes == [str(torch.bfloat16)]
    return {"ok": ok, "dtypes": dtypes, **info}


def compare_outputs(sym, mk, a, b, chunk: int = 1 << 24) -> dict:
    """Stream the symgraph ``--align none`` output against mergekit's and both against the exact
    ``bf16(0.5 A + 0.5 B)`` (fp32 arithmetic): one tensor of each of the four checkpoints in
    memory at a time, compared ``chunk`` elements at a time."""
    import torch
    from safetensors import safe_open
    fs, fm, fa, fb = (tensor_files(p) for p in (sym, mk, a, b))
    names = sorted(fa)
    if set(fs) != set(fa) or set(fm) != set(fa):
        return {"ok": False, "error": "tensor names differ",
                "only_in_symgraph": sorted(set(fs) - set(fm))[:10],
                "only_in_mergekit": sorted(set(fm) - set(fs))[:10]}

    def get(files, k):
        with safe_open(str(files[k]), framework="pt") as h:
            return h.get_tensor(k)

    def diff(x, y):
        x, y = x.float(), y.float()
        d = (x - y).abs()
        ulp = d <= 2.0 ** -7 * torch.maximum(x.abs(), y.abs())
        return float(d.max()), int((d != 0).sum()), bool(ulp.all())

    out = {"tensors": len(names), "elements": 0}
    acc = {k: {"max_abs_diff": 0.0, "elements_differ": 0, "within_1ulp": True, "worst": None}
           for k in ("symgraph_vs_mergekit", "symgraph_vs_exact", "mergekit_vs_exact")}
    t = time.perf_counter()
    for k in names:
        s, m = get(fs, k), get(fm, k)
        if s.shape != m.shape or s.dtype != m.dtype:
            return {"ok": False, "error": f"{k}: {tuple(s.shape)} {s.dtype} vs {tuple(m.shape)} {m.dtype}"}
        ta, tb = get(fa, k).reshape(-1), get(fb, k).reshape(-1)
        s, m = s.reshape(-1), m.reshape(-1)
        out["elements"] += s.numel()
        for i in range(0, s.numel(), chunk):  # fp32 temporaries of one chunk only
            c = slice(i, i + chunk)
            ref = (0.5 * ta[c].float() + 0.5 * tb[c].float()).to(torch.bfloat16)
            for key, (x, y) in (("symgraph_vs_mergekit", (s[c], m[c])), ("symgraph_vs_exact", (s[c], ref)),
                                ("mergekit_vs_exact", (m[c], ref))):
                mx, n, ok = diff(x, y)
                r = acc[key]
                if mx > r["max_abs_diff"]:
                    r["max_abs_diff"], r["worst"] = mx, k
                r["elements_differ"] += n
                r["within_1ulp"] = r["within_1ulp"] and ok
        del s, m, ta, tb
    out.update(acc)
    out["seconds"] = time.perf_counter() - t
    out["ok"] = acc["symgraph_vs_mergekit"]["within_1ulp"]
    return out
