"""Glue that runs Theus et al.'s released weight matching on two of our saved parents.

Runs INSIDE the peer's venv (:mod:`benchmarks.anchor.peer`) as ``python peer_run.py SPEC.json``
and imports nothing from this project; ``SPEC.json`` is what :func:`benchmarks.anchor.peer.start_glue`
writes. Prints one JSON line (also ``out/result.json``).

Their algorithm is not changed: each variant builds their ``merger.GPTMerger`` (absorb the norm
gains, LayerNorm -> RMSNorm, mean subtraction, circuits, then ``weight_matching``) under
``set_seed(seed)`` as their ``eval.py`` does. Spies on ``ortho_residual``/``permute_heads``/
``permute_mlp`` record the maps their matching applies; replayed on B in their absorbed form with
heads (not circuits), they give their aligned B as a GPT-2 checkpoint whose LayerNorms are read as
their RMSNorm: ``out/A`` and ``out/B`` (absorbed, not aligned), ``out/<variant>`` (B aligned) and
``out/<variant>_proj`` (then the merger's untrained random near-identity projection,
``merger.py`` 316-321, as their ``eval.py`` measures "weight matching"). Checks: the replay's
circuits equal their matched B's (``replay_max_abs``); their merger's loss at λ = 0.5 on
``check_ids`` with and without the projection (``merger_mid_loss``).
"""
from __future__ import annotations

import copy
import json
import os
import sys
import time


def _lm_loss(logits, ids) -> float:
    import torch.nn.functional as F
    lg = logits[:, :-1, :].float()
    return float(F.cross_entropy(lg.reshape(-1, lg.shape[-1]), ids[:, 1:].reshape(-1)))


def _permute_heads_factored(model, i, P):
    """Their ``permute_heads`` (``new head h = Σ_j P[h, j]·head j``) on a GPT-2 block whose heads
    are still factored (``c_attn`` [m, 3m] = Q|K|V, ``c_proj`` [m, m])."""
    import torch
    attn = model.transformer.h[i].attn
    h = P.shape[0]
    with torch.no_grad():
        w, b = attn.c_attn.weight, attn.c_attn.bias
        m = w.shape[0]
        d = m // h
        w.copy_(torch.einsum("ij,mqjd->mqid", P, w.reshape(m, 3, h, d)).reshape(m, 3 * m))
        b.copy_(torch.einsum("ij,qjd->qid", P, b.reshape(3, h, d)).reshape(3 * m))
        pw = attn.c_proj.weight
        pw.copy_(torch.einsum("ij,jdo->ido", P, pw.reshape(h, d, -1)).reshape(pw.shape))


def _replay(model, events, fns):
    """Apply recorded maps in order: their ``ortho_residual`` and ``permute_mlp`` (``fns``, the
    unwrapped originals), heads on the factored form."""
    for ev in events:
        if ev[0] == "O":
            fns["ortho_residual"](model, ev[1])
        elif ev[0] == "heads":
            _permute_heads_factored(model, ev[1], ev[2])
        else:
            fns["permute_mlp"](model, ev[1], ev[2])


def _absorbed(src_model, utils):
    """Their ``GPTMerger._absorb`` steps (absorb gains, RMSNorm, mean subtraction) on a copy."""
    m = copy.deepcopy(src_model)
    utils.absorb_ln_scale(m)
    utils.replace_layernorm(m)
    utils.apply_mean_subtraction_to_weights(m)
    return m


def _save(model, path, template_config):
    from transformers import GPT2LMHeadModel
    cfg = copy.deepcopy(template_config)
    cfg.tie_word_embeddings = False  # absorbing the final gain unties the output embedding
    out = GPT2LMHeadModel(cfg)
    sd = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    missing, unexpected = out.load_state_dict(sd, strict=False)
    if [k for k in missing if not k.endswith("attn.bias")] or unexpected:
        raise RuntimeError(f"state does not fit GPT-2: missing {missing}, unexpected {unexpected}")
    out.save_pretrained(path, safe_serialization=True)


def _projection_events(proj, perm: bool, layers: int, utils, MatrixType) -> list:
    """Their merger's projections as maps to replay (``merger.py``'s ``_project``): the residual's
    ORTHO (PERM with permutations only), each layer's heads and MLP PERM."""
    P_res = utils.project(proj["residual"], matrix_type=MatrixType.PERM if perm else MatrixType.ORTHO).detach()
    pev = [("O", P_res)]
    for i in range(layers):
        pev.append(("heads", i, utils.project(proj[f"attention_heads_{i}"], MatrixType.PERM).detach()))
        pev.append(("mlp", i, utils.project(proj[f"mlp_{i}"], MatrixType.PERM).detach()))
    return pev


def _stand_ins() -> None:
    """Stand-ins for ``wandb`` (their logging, off) and ``datasets`` (their split loading, replaced
    by token tensors) where not installed: ``train_merger.py`` imports both."""
    import types

    def load_from_disk(*a, **k):
        raise RuntimeError("datasets is not installed: the glue passes the splits as tensors")
    for name in ("wandb", "datasets"):
        try:
            __import__(name)
        except ImportError:
            mod = types.ModuleType(name)
            mod.load_from_disk = load_from_disk
            sys.modules[name] = mod


def _learned(spec: dict, lv: dict, B_abs, cfg, events: list, orig: dict) -> dict:
    """Their learned matching: ``train_merger.py``'s ``run_training_and_save`` (their HF Trainer:
    AdamW lr 3e-4, cosine, 5% warm-up, weight decay 0.01, validation every 50 steps, early stopping
    after 10, best merger kept; λ ~ U(0.4, 0.6)) with their ``run_merger.sh`` arguments (10 epochs,
    batch 32, ``NARROW_UNIFORM``, seen rows) on our train/validation sequences; ``spec["learn"]``
    may set ``batch_size``, ``epochs`` and ``max_steps``. The weight matching it starts from and its
    trained projections are replayed on B in their absorbed form, saved as ``out/<name>``."""
    import argparse
    import torch
    from transformers import AutoTokenizer, Trainer, TrainingArguments, set_seed

    _stand_ins()
    import train_merger
    import utils
    from enums import MatrixType
    learn, out = spec["learn"], spec["out"]
    ids = {k: torch.load(spec["learn"][k], map_location="cpu").long() for k in ("train_ids", "val_ids")}

    class Seqs(torch.utils.data.Dataset):  # what their group_texts gives: input_ids, attention_mask
        def __init__(self, x):
            self.x = x

        def __len__(self):
            return len(self.x)

        def __getitem__(self, i):
            return {"input_ids": self.x[i], "attention_mask": torch.ones_like(self.x[i])}
    args = argparse.Namespace(
        model_dir_0=spec["model_a"], model_dir_1=spec["model_b"], tokenizer_dir=learn["tokenizer"],
        output_dir=os.path.join(out, "merger-" + lv["name"]), seed=int(spec.get("seed", 42)),
        sampler="NARROW_UNIFORM", permutations_only=bool(lv["permutations_only"]), block_size=ids["train_ids"].shape[1],
        batch_size=int(learn.get("batch_size", 32)), epochs=float(learn.get("epochs", 10)), lr=3e-4,
        warmup_ratio=0.05, weight_decay=0.01, eval_steps=50, logging_steps=25, save_total_limit=2, fp16=True,
        early_stop=True, early_stop_patience=10, token_freqs_path=spec["token_freqs"], wandb=False)
    max_steps = learn.get("max_steps")

    def training_args(**kw):  # their TrainingArguments, capped at max_steps where a budget says so
        return TrainingArguments(**kw, **({"max_steps": int(max_steps)} if max_steps else {}))
    trainers = []

    class Recorded(Trainer):  # their Trainer, kept for its state (steps, evaluations, best checkpoint)
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            trainers.append(self)
    train_merger.TrainingArguments, train_merger.Trainer = training_args, Recorded
    tok = AutoTokenizer.from_pretrained(args.tokenizer_dir)
    tok.pad_token = tok.eos_token  # as their main()
    events.clear()
    set_seed(args.seed)  # their main(): set_seed(args.seed) before building the merger
    t0 = time.perf_counter()
    wrapper = train_merger.run_training_and_save(args, tok, Seqs(ids["train_ids"]), Seqs(ids["val_ids"]))
    seconds = time.perf_counter() - t0
    mg = wrapper.merger_model.cpu().eval()
    pev = _projection_events(mg.proj, args.permutations_only, len(B_abs.transformer.h), utils, MatrixType)
    B_l = copy.deepcopy(B_abs)
    with torch.no_grad():
        _replay(B_l, [*events, *pev], orig)
    path = os.path.join(out, lv["name"])
    _save(B_l, path, cfg)
    state = trainers[-1].state
    hist = [h for h in state.log_history if "eval_loss" in h]
    return {"name": lv["name"], "permutations_only": args.permutations_only, "dir": path, "seconds": seconds,
            "steps": state.global_step, "best_checkpoint": state.best_model_checkpoint,
            "evals": [(h["step"], h["eval_loss"]) for h in hist], "batch_size": args.batch_size,
            "epochs": args.epochs, "max_steps": max_steps}


def _max_abs(a, b) -> float:
    sa, sb = a.state_dict(), b.state_dict()
    return max(float((sa[k].float() - sb[k].float()).abs().max()) for k in sa if sa[k].is_floating_point())


def run(spec: dict) -> dict:
    sys.path.insert(0, spec["src"])
    import torch
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel, set_seed

    import merger as merger_mod
    import utils
    import weight_matching as wm
    from enums import MatrixType

    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    out = spec["out"]
    os.makedirs(out, exist_ok=True)
    events: list = []
    timing = {}
    orig = {k: getattr(wm, k) for k in ("ortho_residual", "permute_heads", "permute_mlp")}

    def spy(fn, tag):  # record the map, then apply it with their function
        def wrapped(model, *args, **kw):
            vals = [*args, *kw.values()]  # (O) or (layer, P); their permute_mlp passes P=...
            events.append((tag, *vals[:-1], vals[-1].detach().clone()))
            return fn(model, *args, **kw)
        return wrapped
    wm.ortho_residual = spy(orig["ortho_residual"], "O")
    wm.permute_heads = spy(orig["permute_heads"], "heads")
    wm.permute_mlp = spy(orig["permute_mlp"], "mlp")
    wm_fn = merger_mod.weight_matching

    def timed_wm(*a, **k):
        t0 = time.perf_counter()
        r = wm_fn(*a, **k)
        timing["weight_matching"] = time.perf_counter() - t0
        return r
    merger_mod.weight_matching = timed_wm

    def load(path):
        m = GPT2LMHeadModel.from_pretrained(path).eval()
        m.config.attn_implementation = "eager"  # as their train_merger.py / eval.py
        m._attn_implementation = "eager"
        return m

    freqs = torch.load(spec["token_freqs"], map_location="cpu") if spec.get("token_freqs") else None
    check = torch.load(spec["check_ids"], map_location="cpu").long() if spec.get("check_ids") else None
    A0, B0 = load(spec["model_a"]), load(spec["model_b"])
    cfg = GPT2Config.from_pretrained(spec["model_a"])  # A's own config (not the eager switch above)
    A_abs, B_abs = _absorbed(A0, utils), _absorbed(B0, utils)
    _save(A_abs, os.path.join(out, "A"), cfg)
    _save(B_abs, os.path.join(out, "B"), cfg)  # B in their absorbed form, not aligned
    res = {"versions": {"torch": torch.__version__, "transformers": transformers.__version__},
           "A": os.path.join(out, "A"), "B": os.path.join(out, "B"), "variants": []}
    for v in spec["variants"]:
        if v.get("seen") and freqs is None:
            raise SystemExit(f"variant {v['name']}: seen-token rows need token_freqs")
        events.clear()
        timing.clear()
        m0, m1 = load(spec["model_a"]), load(spec["model_b"])
        set_seed(int(spec.get("seed", 42)))  # their eval.py: set_seed(args.seed) before GPTMerger
        t0 = time.perf_counter()
        mg = merger_mod.GPTMerger(m0, m1, token_freqs=freqs if v.get("seen") else None,
                                  permutations_only=bool(v.get("permutations_only")))
        total = time.perf_counter() - t0
        mg.eval()
        perm = bool(v.get("permutations_only"))
        rec = {"name": v["name"], "permutations_only": perm, "seen": bool(v.get("seen")),
               "seconds_merger": total, "seconds_weight_matching": timing.get("weight_matching"),
               "n_maps": len(events)}
        # their aligned B, heads factored: replay the recorded maps on B in their absorbed form
        B_al = copy.deepcopy(B_abs)
        _replay(B_al, list(events), orig)
        circ = copy.deepcopy(B_al)
        for i in range(len(circ.transformer.h)):
            utils.project_to_attn_circuits(circ, i)
        rec["replay_max_abs"] = _max_abs(circ, m1)  # m1: their matched B (circuit form)
        rec["dirs"] = {"noproj": os.path.join(out, v["name"]), "proj": os.path.join(out, v["name"] + "_proj")}
        _save(B_al, rec["dirs"]["noproj"], cfg)
        # the merger's untrained projection: residual ORTHO (PERM with permutations only), heads/MLP PERM
        proj = mg.proj
        pev = _projection_events(proj, perm, len(B_al.transformer.h), utils, MatrixType)
        P_res = pev[0][1]
        rec["projection_is_identity"] = all(bool(torch.equal(e[-1], torch.eye(e[-1].shape[0]))) for e in pev)
        rec["projection_residual_dist"] = float((P_res - torch.eye(P_res.shape[0])).norm())
        B_pr = copy.deepcopy(B_al)
        with torch.no_grad():
            _replay(B_pr, pev, orig)
        _save(B_pr, rec["dirs"]["proj"], cfg)
        if check is not None:  # their merger (their interpolation) at λ = 0.5, with and without the projection
            mid = {}
            with torch.no_grad():
                mg.set_sampler(sampler_type=None, fixed_coeff=0.5)
                mid["proj"] = _lm_loss(mg(input_ids=check).logits, check)
                for k, p in proj.items():
                    p.copy_(torch.eye(*p.shape))
                mid["noproj"] = _lm_loss(mg(input_ids=check).logits, check)
            rec["merger_mid_loss"] = mid
        res["variants"].append(rec)
    res["learned"] = [_learned(spec, lv, B_abs, cfg, events, orig) for lv in spec.get("learned") or []]
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        print(json.dumps(run(json.load(f))), flush=True)
