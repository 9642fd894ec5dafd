"""Shared tiny-model fixtures: random-weight, two-layer configs of the architectures symgraph
must understand, each analysed once per session.

Every 1-d parameter (norm weights, biases) is re-drawn at random: Hugging Face initialises
norm weights to ones and biases to zeros, which every permutation leaves unchanged and would
hide a wrong bias or norm slot from the certificates.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

import symgraph  # noqa: E402

transformers.logging.set_verbosity_error()

LAYERS = 2
ATTN = "sdpa"


@dataclass
class Tiny:
    """A tiny model, its config, the inputs it was analysed with (None: built from the
    config) and its report."""
    name: str
    model: torch.nn.Module
    report: object
    config: object = None
    inputs: object = None
    info: dict = field(default_factory=dict)


def randomize_vectors(model, seed=0):
    """Re-draw every 1-d parameter (norm weights around 1, biases around 0)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and not p.is_meta:
                noise = torch.randn(p.shape, generator=gen, dtype=p.dtype)
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.5 * noise)
    return model


# --- builders (also used directly by tests that need a fresh model) -------------------------
def bert_config():
    return transformers.BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=LAYERS, num_attention_heads=4,
        intermediate_size=24, max_position_embeddings=32, type_vocab_size=2,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, attn_implementation=ATTN)


def gpt2_config():
    return transformers.GPT2Config(
        vocab_size=64, n_embd=16, n_layer=LAYERS, n_head=4, n_inner=40, n_positions=32,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation=ATTN,
        bos_token_id=0, eos_token_id=0)


def llama_config():
    return transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=48, max_position_embeddings=32,
        attn_implementation=ATTN, bos_token_id=0, eos_token_id=0, pad_token_id=0)


def vit_config():
    return transformers.ViTConfig(
        image_size=8, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=LAYERS,
        num_attention_heads=4, intermediate_size=24, num_labels=3, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, attn_implementation=ATTN)


def phi_config():
    return transformers.PhiConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=4,
        intermediate_size=48, max_position_embeddings=32, partial_rotary_factor=0.5,
        resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0, attn_implementation=ATTN,
        bos_token_id=0, eos_token_id=0, pad_token_id=0)


def gptj_config():
    return transformers.GPTJConfig(
        vocab_size=64, n_embd=32, n_layer=LAYERS, n_head=4, rotary_dim=4, n_inner=48,
        n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        attn_implementation="eager",  # GPT-J has no SDPA path: this covers matmul + softmax
        bos_token_id=0, eos_token_id=0, pad_token_id=0)


def neox_config():
    return transformers.GPTNeoXConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=4,
        intermediate_size=48, max_position_embeddings=32, rotary_pct=0.5, hidden_dropout=0.0,
        attention_dropout=0.0, attn_implementation=ATTN, bos_token_id=0, eos_token_id=0,
        pad_token_id=0)


HF = {
    "bert": (transformers.BertForMaskedLM, bert_config),
    "gpt2": (transformers.GPT2LMHeadModel, gpt2_config),
    "llama": (transformers.LlamaForCausalLM, llama_config),
    "vit": (transformers.ViTForImageClassification, vit_config),
    "phi": (transformers.PhiForCausalLM, phi_config),
    "gptj": (transformers.GPTJForCausalLM, gptj_config),
    "neox": (transformers.GPTNeoXForCausalLM, neox_config),
}


def build_hf(name, seed=0, device=None):
    cls, make_cfg = HF[name]
    cfg = make_cfg()
    torch.manual_seed(seed)
    if device is not None:
        with torch.device(device):
            model = cls(cfg)
    else:
        model = randomize_vectors(cls(cfg), seed)
    return model.eval(), cfg


def build_transformer_encoder(seed=0, d=16, heads=4, ff=40):
    torch.manual_seed(seed)
    layer = torch.nn.TransformerEncoderLayer(d, heads, ff, dropout=0.0, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
    model = randomize_vectors(model, seed).eval()
    x = torch.randn(2, 5, d, generator=torch.Generator().manual_seed(seed))
    return model, (x,), {"d": d, "heads": heads, "ff": ff}


def build_mlp(seed=0, widths=(6, 16, 12, 3)):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(widths[0], widths[1]), torch.nn.ReLU(),
        torch.nn.Linear(widths[1], widths[2]), torch.nn.GELU(),
        torch.nn.Linear(widths[2], widths[3]))
    model = randomize_vectors(model, seed).eval()
    x = torch.randn(4, widths[0], generator=torch.Generator().manual_seed(seed))
    return model, (x,), {"widths": widths}


def _hf_fixture(name):
    model, cfg = build_hf(name)
    return Tiny(name, model, symgraph.analyze(model), cfg)


@pytest.fixture(scope="session")
def bert():
    return _hf_fixture("bert")


@pytest.fixture(scope="session")
def gpt2():
    return _hf_fixture("gpt2")


@pytest.fixture(scope="session")
def llama():
    return _hf_fixture("llama")


@pytest.fixture(scope="session")
def vit():
    return _hf_fixture("vit")


@pytest.fixture(scope="session")
def phi():
    return _hf_fixture("phi")


@pytest.fixture(scope="session")
def gptj():
    return _hf_fixture("gptj")


@pytest.fixture(scope="session")
def neox():
    return _hf_fixture("neox")


@pytest.fixture(scope="session")
def encoder():
    model, inputs, info = build_transformer_encoder()
    return Tiny("encoder", model, symgraph.analyze(model, inputs=inputs), None, inputs, info)


@pytest.fixture(scope="session")
def mlp():
    model, inputs, info = build_mlp()
    return Tiny("mlp", model, symgraph.analyze(model, inputs=inputs), None, inputs, info)


@pytest.fixture
def tiny(request):
    """Indirect access to the session fixtures by name (for parametrised tests)."""
    return request.getfixturevalue(request.param)
