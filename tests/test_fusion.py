"""Heterogeneous fusion (issue 15): unit masses that count, so that any function-preserving
widening (units copied 1-4 times, outgoing weights split unevenly) is fused back exactly."""
from __future__ import annotations

import copy

import pytest
import torch

import symgraph
from symgraph.testing import models
from symgraph.testing.models import randomize_vectors
from symgraph.solve import optimal_transport


def _copies(n, seed, ks=None):
    """``(src, alpha)``: widened unit j copies unit ``src[j]`` with outgoing share ``alpha[j]``
    (Dirichlet over each unit's copies, so unevenly), multiplicities ``ks`` (default: 1-4 at
    random, each of 1, 2, 3, 4 present), shuffled."""
    g = torch.Generator().manual_seed(seed)
    if ks is None:
        ks = torch.randint(1, 5, (n,), generator=g)
        ks[:4] = torch.tensor([1, 2, 3, 4])
    src = torch.repeat_interleave(torch.arange(n), torch.as_tensor(ks))
    alpha = torch.empty(len(src), dtype=torch.float64)
    torch.manual_seed(seed)
    for i in range(n):
        idx = (src == i).nonzero().flatten()
        alpha[idx] = torch.distributions.Dirichlet(torch.ones(len(idx), dtype=torch.float64)).sample()
    order = torch.randperm(len(src), generator=g)
    return src[order], alpha[order]


def _widen_state(sd, co, contra, src, alpha):
    """Copy rows of the ``co`` tensors (dim 0), split columns of the ``contra`` ones (dim 1)."""
    out = {}
    for k, v in sd.items():
        if k.endswith(co):
            v = v[src]
        elif k.endswith(contra):
            v = v[:, src] * alpha.to(v.dtype)
        out[k] = v.clone()
    return out


def _rel(a, b):
    return float((a - b).norm() / a.norm())


def _hf_out(m, x):
    with torch.no_grad():
        o = m(input_ids=x)
    return o.logits if hasattr(o, "logits") else o.last_hidden_state


def test_masses_make_the_exact_plan_follow_the_copies():
    """Three A units; B copies unit 0 three times (shares .2/.3/.5) and unit 2 twice: with
    contribution masses the exact plan sends every copy wholly to its original."""
    S = torch.tensor([[1.0, 0.9, 0.95, 0.1, 0.0, 0.1],
                      [0.2, 0.1, 0.1, 1.0, 0.3, 0.2],
                      [0.0, 0.1, 0.2, 0.1, 1.0, 0.9]], dtype=torch.float64)
    a = torch.tensor([1.0, 1.0, 1.0], dtype=torch.float64)
    b = torch.tensor([0.2, 0.3, 0.5, 1.0, 0.6, 0.4], dtype=torch.float64)
    T = optimal_transport(S, a=a, b=b).element
    assert torch.equal(T.argmax(0), torch.tensor([0, 0, 0, 1, 2, 2]))
    assert int((T > 1e-12).sum()) == 6  # one A unit per column: no copy is split
    T_uniform = optimal_transport(S).element
    # uniform marginals: two units each, so a copy of unit 0 goes elsewhere
    assert not torch.equal(T_uniform.argmax(0), torch.tensor([0, 0, 0, 1, 2, 2]))


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-6), (torch.float32, 1e-4)])
def test_mlp_widened_k_times_fuses_back(k, dtype, tol):
    A = models.mlp(0, (6, 16, 12, 3)).to(dtype)
    src, alpha = _copies(16, seed=k, ks=[k] * 8 + [1 + (k % 4)] * 8)
    sd = _widen_state(A.state_dict(), ("0.weight", "0.bias"), ("2.weight",), src, alpha)
    B = models.mlp(0, (6, len(src), 12, 3)).to(dtype)
    B.load_state_dict(sd)
    x = torch.randn(64, 6, dtype=dtype, generator=torch.Generator().manual_seed(1))
    assert _rel(A(x), B(x)) < tol  # the widening preserves the function
    al = symgraph.align(A, B, (x,))
    assert _rel(A(x), al.apply(B)(x).detach()) < tol
    merged = symgraph.merge([A, B], (x,)).model
    assert merged[0].weight.shape == (16, 6)
    assert _rel(A(x), merged(x).detach()) < tol
    if k > 1:  # uniform marginals cannot do it
        assert _rel(A(x), symgraph.align(A, B, (x,), masses="uniform").apply(B)(x).detach()) > 10 * tol


@pytest.mark.parametrize("arch,co,contra", [
    ("llama", ("gate_proj.weight", "up_proj.weight"), ("down_proj.weight",)),
    ("bert", ("intermediate.dense.weight", "intermediate.dense.bias"), ("output.dense.weight",)),
])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-6), (torch.float32, 1e-4)])
@pytest.mark.slow
def test_transformer_mlp_widened_unevenly_fuses_back(arch, co, contra, dtype, tol):
    A = randomize_vectors(models.build(arch, 0), 0).to(dtype).eval()
    if arch == "bert":  # the MLP's output projection, not the attention's (also "output.dense")
        contra = tuple(f"layer.{i}.output.dense.weight" for i in range(A.config.num_hidden_layers))
    src, alpha = _copies(A.config.intermediate_size, seed=3)
    cfg = copy.deepcopy(A.config)
    cfg.intermediate_size = len(src)
    B = type(A)(cfg).to(dtype).eval()
    B.load_state_dict(_widen_state(A.state_dict(), co, contra, src, alpha))
    x = torch.randint(0, A.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    la = _hf_out(A, x)
    assert _rel(la, _hf_out(B, x)) < tol
    err = _rel(la, _hf_out(symgraph.align(A, B).apply(B), x))
    assert err < tol
    assert _rel(la, _hf_out(symgraph.merge([A, B]).model, x)) < tol
    assert _rel(la, _hf_out(symgraph.align(A, B, masses="uniform").apply(B), x)) > 100 * max(err, 1e-9)


def test_heads_copied_unevenly_fuse_back():
    """LLaMA with 4 heads widened to 10 (multiplicities 1-4, output projection split
    unevenly): the head transport with head masses returns A's function."""
    A = randomize_vectors(models.build("llama", 0, num_attention_heads=4, num_key_value_heads=4,
                                       head_dim=8), 0).double().eval()
    src, alpha = _copies(4, seed=5, ks=[1, 2, 3, 4])
    cfg = copy.deepcopy(A.config)
    cfg.num_attention_heads = cfg.num_key_value_heads = len(src)
    B = type(A)(cfg).double().eval()
    sd = {k: v.clone() for k, v in A.state_dict().items()}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}.self_attn."
        for w in ("q_proj", "k_proj", "v_proj"):
            sd[p + w + ".weight"] = sd[p + w + ".weight"].reshape(4, 8, -1)[src].reshape(8 * len(src), -1)
        O = sd[p + "o_proj.weight"].reshape(-1, 4, 8)
        sd[p + "o_proj.weight"] = (O[:, src] * alpha[None, :, None]).reshape(O.shape[0], -1)
    B.load_state_dict(sd)
    x = torch.randint(0, A.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    la = _hf_out(A, x)
    assert _rel(la, _hf_out(B, x)) < 1e-12
    assert _rel(la, _hf_out(symgraph.merge([A, B]).model, x)) < 1e-6
    assert _rel(la, _hf_out(symgraph.align(A, B, masses="uniform").apply(B), x)) > 1e-3


def test_masses_option_is_checked():
    A = models.mlp(0)
    with pytest.raises(symgraph.InputError, match="masses"):
        symgraph.align(A, A, (torch.randn(2, 6),), masses="norms")


@pytest.mark.parametrize("masses", ["auto", "weights"])
def test_resized_with_random_splits_fuses_back_from_activations(masses):
    """``symgraph.resize`` widens both hidden layers with random shares; matching from
    activations (masses from activation RMS × outgoing norm) fuses it back like matching
    from weights."""
    A = models.mlp(0, (6, 16, 12, 3)).double()
    x = torch.randn(64, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    r = symgraph.analyze(A, (x,))
    B = symgraph.resize(A, {g.id: 2 * g.size + 5 for g in r.groups}, (x,), split="random").model
    data = [(x[i:i + 16],) for i in range(0, 64, 16)]
    merged = symgraph.merge([A, B], align="activations", data=data, masses=masses).model
    assert _rel(A(x), merged(x).detach()) < 1e-6
    # two consecutive widened layers: the masses of the first read the second's map
    assert _rel(A(x), symgraph.merge([A, B], (x,), masses=masses).model(x).detach()) < 1e-6
