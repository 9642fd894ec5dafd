"""Two checkpoints of one vision-language model whose ``text_config`` differs only in the dtype
loading stamps (one saved from a model built in float32, one from the model loaded with
``dtype=torch.float64``) are one configuration; a sub-config field that changes the function
is refused by its path. Found by the coverage round trip (``benchmarks/coverage/roundtrip.py``):
Idefics3's merge with a moved copy of itself was refused for ``text_config``'s dtype."""
from __future__ import annotations

import pytest
import transformers as tf

from symgraph.checkpoints.specs import check_same_configs
from symgraph.errors import InputError


def llava(**text):
    return tf.LlavaConfig(text_config=tf.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=24,
                                                     num_hidden_layers=1, num_attention_heads=2, **text))


def test_a_sub_configs_dtype_is_metadata():
    a, b = llava(), llava()
    b.text_config.dtype = "float64"
    assert a.to_dict()["text_config"]["dtype"] != b.to_dict()["text_config"]["dtype"]
    check_same_configs([a, b], ["a", "b"])


def test_a_sub_configs_function_field_is_refused_by_its_path():
    with pytest.raises(InputError, match=r"differ in config field 'text_config.hidden_act' \('silu' vs 'gelu'\)"):
        check_same_configs([llava(), llava(hidden_act="gelu")], ["a", "b"])
    with pytest.raises(InputError, match=r"differ in config field 'text_config.rms_norm_eps'"):
        check_same_configs([llava(), llava(rms_norm_eps=1e-3)], ["a", "b"])
