"""Issue 65, soundness of unread towers. A parameter the traced program never reads (an audio
tower on text-only inputs) is read on inputs of another kind, with activations the trace never
saw: every parameter stays fixed and the report names it (``SymmetryReport.unread``). Inputs
that read the tower give its classes back, and an element found on them keeps the function on
inputs of the other kind. A parameter the program reads but no kept output depends on (a
pooler whose output is dropped) is not unread: it alone stays fixed. ``x[idx] = v`` (Wav2Vec2's
masked frames) moves ``v`` with the axis it is written along."""
from __future__ import annotations

import torch
import torch.nn as nn

import symgraph
from symgraph.passes.inputs import default_inputs


class SpeechLM(nn.Module):
    """A text stream that an optional audio tower writes into, read by a head."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Linear(6, 8), nn.Linear(8, 3)
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)
        self.tower = nn.Sequential(nn.Linear(5, 12), nn.GELU(), nn.Linear(12, 8))
        self.pool = nn.Linear(8, 4)

    def forward(self, x, audio=None):
        s = self.embed(x)
        if audio is not None:
            s = s + self.tower(audio)
        s = s + self.down(torch.relu(self.up(s)))
        return self.head(s), self.pool(s.mean(1))


def _claimed(rep) -> set:
    return {p for g in rep.groups if g.kind != "identity" for p, _ in g.params}


def _text():
    torch.manual_seed(1)
    return (torch.randn(2, 4, 6),)


def _both():
    torch.manual_seed(2)
    return (torch.randn(2, 4, 6), torch.randn(2, 4, 5))


def _same(A, B, inp) -> float:
    with torch.no_grad():
        return max(float((a - b).abs().max()) for a, b in zip(A(*inp), B(*inp)))


def test_an_unread_tower_leaves_nothing_claimed_and_says_which():
    torch.manual_seed(0)
    A = SpeechLM().eval()
    rep = symgraph.analyze(A, _text())
    assert _claimed(rep) == set() and rep.groups == []
    assert rep.unread == ("tower.0.weight (and 3 more) is never read by the traced inputs: "
                          "pass inputs that use it")
    assert rep.unread in rep.summary() and rep.to_dict()["unread"] == rep.unread
    why = [r for leaf in rep.axis_reasons("up.weight", 0) for _, r in leaf["reasons"]]
    assert rep.unread in why
    assert rep.certify(A, _text()) <= 1e-6
    B = symgraph.transform(A, rep.random_transform(seed=3))
    assert _same(A, B, _both()) == 0.0  # the other input kind: nothing was moved


def test_inputs_that_read_the_tower_give_its_classes_on_both_kinds():
    torch.manual_seed(0)
    A = SpeechLM().eval()
    rep = symgraph.analyze(A, _both())
    assert rep.unread is None
    stream = next(g for g in rep.groups if ("embed.weight", 0) in g.params)
    assert {("tower.2.weight", 0), ("up.weight", 1), ("down.weight", 0), ("head.weight", 1),
            ("pool.weight", 1)} <= set(stream.params) and stream.kind != "identity"
    hidden = next(g for g in rep.groups if ("tower.0.weight", 0) in g.params)
    assert hidden.kind == "perm" and ("tower.2.weight", 1) in hidden.params
    assert rep.certify(A, _both()) <= 1e-6
    B = symgraph.transform(A, rep.random_transform(seed=3, orthogonal=True))
    assert float((A.tower[0].weight - B.tower[0].weight).abs().max()) > 0.1
    assert float((A.embed.weight - B.embed.weight).abs().max()) > 0.1
    assert _same(A, B, _both()) < 1e-5
    assert _same(A, B, _text()) < 1e-5  # the other input kind keeps its function too
    C = symgraph.align(A, B, _both()).apply(B)  # B aligned back: the merge of A and B is A
    for (n, p), q in zip(A.named_parameters(), C.parameters()):
        assert float((p - q).abs().max()) < 1e-5, n
    assert _same(A, C, _text()) < 1e-5


def test_a_read_output_not_kept_fixes_only_its_own_parameters():
    torch.manual_seed(0)
    A = SpeechLM().eval()
    rep = symgraph.analyze(A, _both(), outputs=[0])
    assert rep.unread is None
    claimed = _claimed(rep)
    assert "pool.weight" not in claimed and {"embed.weight", "up.weight", "tower.0.weight"} <= claimed
    why = [r for leaf in rep.axis_reasons("pool.weight", 0) for _, r in leaf["reasons"]]
    assert any("no output kept reads it" in r for r in why)
    assert rep.certify(A, _both()) <= 1e-6


class Tied(nn.Module):
    """An embedding and a head that share one tensor under two names."""

    def __init__(self):
        super().__init__()
        self.emb, self.mid = nn.Embedding(10, 8), nn.Linear(8, 8)
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(torch.relu(self.mid(self.emb(ids))))


def test_a_tied_name_the_program_reads_under_another_is_read():
    torch.manual_seed(0)
    A, ids = Tied().eval(), (torch.randint(0, 10, (2, 5)),)
    rep = symgraph.analyze(A, ids)
    assert rep.unread is None and "mid.weight" in _claimed(rep)
    assert rep.certify(A, ids) <= 1e-6


class Masked(nn.Module):
    """Frames picked by a mask replaced by a learned vector (Wav2Vec2's ``masked_spec_embed``)."""

    def __init__(self):
        super().__init__()
        self.proj, self.up, self.down = nn.Linear(5, 8), nn.Linear(8, 16), nn.Linear(16, 8)
        self.masked = nn.Parameter(torch.randn(8))
        self.head = nn.Linear(8, 3)

    def forward(self, x, mask):
        h = self.proj(x)
        h[mask] = self.masked
        return self.head(h + self.down(torch.relu(self.up(h))))


def test_a_masked_write_moves_the_written_vector_with_its_axis():
    torch.manual_seed(0)
    A = Masked().eval()
    mask = torch.zeros(2, 6, dtype=torch.bool)
    mask[:, 1::3] = True
    inp = (torch.randn(2, 6, 5), mask)
    rep = symgraph.analyze(A, inp)
    stream = next(g for g in rep.groups if ("masked", 0) in g.params)
    assert stream.kind != "identity" and {("proj.weight", 0), ("head.weight", 1)} <= set(stream.params)
    assert rep.certify(A, inp) <= 1e-6
    B = symgraph.transform(A, rep.random_transform(seed=5))
    assert float((A.masked - B.masked).abs().max()) > 0.1
    other = (torch.randn(2, 6, 5), torch.rand(2, 6) > 0.5)  # another mask
    with torch.no_grad():
        assert float((A(*other) - B(*other)).abs().max()) < 1e-5


def test_a_speech_encoder_gets_masked_frames_where_its_forward_takes_them():
    import transformers
    cfg = transformers.Wav2Vec2Config(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                      intermediate_size=24, conv_dim=(8, 8), conv_stride=(5, 2),
                                      conv_kernel=(10, 3), num_conv_pos_embeddings=4,
                                      num_conv_pos_embedding_groups=2, vocab_size=12)
    torch.manual_seed(0)
    model = transformers.Wav2Vec2Model(cfg).eval()
    _, kw = default_inputs(model)
    frames = int(model._get_feat_extract_output_lengths(torch.tensor(kw["input_values"].shape[-1])))
    assert kw["mask_time_indices"].shape == (2, frames) and kw["mask_time_indices"].any()
    rep = symgraph.analyze(model)
    assert rep.unread is None
    # the stream is an output here (``last_hidden_state``), the MLP's units are not
    assert any(p.endswith("feed_forward.intermediate_dense.weight") for p in _claimed(rep))
    assert rep.certify(model) <= 1e-6


class DroppedPooler(nn.Module):
    """A pooler the forward computes and then drops: read, though no output depends on it."""

    def __init__(self):
        super().__init__()
        self.embed, self.up, self.down = nn.Linear(6, 8), nn.Linear(8, 16), nn.Linear(16, 8)
        self.pool, self.head = nn.Linear(8, 4), nn.Linear(8, 3)

    def forward(self, x):
        s = self.embed(x)
        s = s + self.down(torch.relu(self.up(s)))
        self.pool(s.mean(1))  # computed, not returned
        return self.head(s)


def test_a_value_computed_then_dropped_is_read_not_unread():
    torch.manual_seed(0)
    A, inp = DroppedPooler().eval(), _text()
    rep = symgraph.analyze(A, inp)
    assert rep.unread is None
    claimed = _claimed(rep)
    assert "pool.weight" not in claimed and {"embed.weight", "up.weight"} <= claimed
    assert rep.certify(A, inp) <= 1e-6


def _tiny_hubert_ctc():
    import transformers as T
    cfg = T.HubertConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=24,
                         conv_dim=(8, 8), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=4,
                         num_conv_pos_embedding_groups=2, vocab_size=12)
    torch.manual_seed(0)
    return T.HubertForCTC(cfg).eval()


def test_a_ctc_head_reads_its_masked_frames_through_its_kwargs():
    """``HubertForCTC`` hands ``**kwargs`` to its encoder, whose forward takes
    ``mask_time_indices``: the example masks frames, so ``masked_spec_embed`` is read, moves
    with the stream, and an element found so keeps the function on unmasked inputs too."""
    A = _tiny_hubert_ctc()
    _, kw = default_inputs(A)
    assert kw["mask_time_indices"].shape == (2, 8) and int(kw["mask_time_indices"].sum()) == 6
    rep = symgraph.analyze(A)
    assert rep.unread is None
    stream = next(g for g in rep.groups if ("hubert.masked_spec_embed", 0) in g.params)
    assert stream.kind != "identity" and ("lm_head.weight", 1) in stream.params
    assert rep.certify(A) <= 1e-6
    B = symgraph.transform(A, rep.random_transform(seed=4))
    assert float((A.hubert.masked_spec_embed - B.hubert.masked_spec_embed).abs().max()) > 0.1
    with torch.no_grad():
        plain = {"input_values": kw["input_values"]}  # the other input kind: nothing masked
        assert float((A(**plain).logits - B(**plain).logits).abs().max()) < 1e-5
        assert float((A(**kw).logits - B(**kw).logits).abs().max()) < 1e-5


def test_a_speech_language_model_reads_its_audio_tower():
    """GLM-ASR: log-mel features and, in each row, as many audio tokens as its own
    ``get_audio_features`` gives embeddings (channels first, found by the model refusing
    frames first); its audio tower then has classes, certified."""
    import transformers as T
    audio = T.GlmAsrEncoderConfig(hidden_size=32, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                                  num_key_value_heads=2, num_mel_bins=16, max_position_embeddings=64)
    text = T.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    m = T.GlmAsrForConditionalGeneration(T.GlmAsrConfig(audio_config=audio, text_config=text, audio_token_id=63)).eval()
    _, kw = default_inputs(m)
    assert kw["input_features"].shape[:2] == (2, 16)  # channels first
    n = int((kw["input_ids"] == 63).sum(1)[0])
    with torch.no_grad():
        emb = m.get_audio_features(kw["input_features"], kw["input_features_mask"]).pooler_output
    assert n > 0 and n * 2 * 32 == emb.numel()
    rep = symgraph.analyze(m)
    assert rep.unread is None
    assert any(p.startswith("model.audio_tower.") for p in _claimed(rep))
    assert rep.certify(m) <= 1e-6


def test_aligning_or_merging_where_nothing_can_move_is_refused_not_averaged():
    """Where an unread tower fixes every parameter, aligning finds only the identity: a merge
    asking for alignment would silently average two unaligned models. It is refused in one
    line naming the tower and the two ways out; without alignment the average is what was asked."""
    torch.manual_seed(0)
    A, B = SpeechLM().eval(), SpeechLM().eval()
    for call in (lambda: symgraph.align(A, B, inputs=_text()),
                 lambda: symgraph.merge([A, B], inputs=_text(), align="weights")):
        try:
            call()
        except symgraph.InputError as e:
            assert "tower.0.weight (and 3 more) is never read" in str(e) and "align 'none'" in str(e)
        else:
            raise AssertionError("an alignment of nothing was not refused")
    merged = symgraph.merge([A, B], inputs=_text(), align="none").model
    assert torch.equal(merged.up.weight, (A.up.weight + B.up.weight) / 2)
    al = symgraph.align(A, B, inputs=_both())  # inputs that read the tower: classes to align
    assert al.report_a.unread is None and any(g.kind != "identity" for g in al.report_a.groups)
