"""The ranges of a vocabulary that hold a tokenizer's codes stay inside the shrunk vocabulary
(Apertus 1.5: the visual and audio code ranges end to end, the last within the text
vocabulary; its config's validator refused the shrunk config before)."""
from __future__ import annotations

from types import SimpleNamespace

from benchmarks import coverage as cov
from benchmarks.coverage.derived import CODEBOOK, code_ranges


class _Sub(SimpleNamespace):
    def to_dict(self):
        return vars(self)


def _level(image_book=131072, audio_book=4096, audio_offset=262344):
    fields = {"text_config": _Sub(vocab_size=266752), "vision_config": _Sub(codebook_size=image_book),
              "audio_config": _Sub(codebook_size=audio_book), "image_token_offset": 131272,
              "audio_token_offset": audio_offset, "image_token_id": 131079}
    out = {"text_config": {"vocab_size": 256}, "vision_config": {"codebook_size": image_book},
           "audio_config": {"codebook_size": audio_book}}
    return fields, out


def test_ranges_end_to_end_inside_the_shrunk_vocabulary():
    fields, out = _level()
    res = code_ranges(fields, out, 254)
    assert res["image_token_offset"] == 131272 * 256 // 266752 == 125
    assert res["vision_config"]["codebook_size"] == res["audio_config"]["codebook_size"] == CODEBOOK
    assert res["audio_token_offset"] == 125 + CODEBOOK
    assert res["audio_token_offset"] + CODEBOOK <= 254


def test_ranges_kept_below_the_renumbered_ids():
    fields, out = _level()
    res = code_ranges(fields, out, 130)  # ids from 130 up taken by renumbered tokens
    assert res["image_token_offset"] == 130 - 2 * CODEBOOK
    assert res["audio_token_offset"] + CODEBOOK == 130


def test_no_ranges_where_the_defaults_state_none():
    fields, out = _level(audio_offset=262000)  # the visual range does not end where audio begins
    assert code_ranges(fields, out, 254) == {}
    fields, out = _level()
    del fields["image_token_offset"], fields["audio_token_offset"]
    assert code_ranges(fields, out, 254) == {}
    fields, out = _level()
    out["text_config"]["vocab_size"] = 266752  # not shrunk: nothing to move
    assert code_ranges(fields, out, 254) == {}


def test_apertus_shrunk_config_passes_its_validator():
    cfg, _ = cov.tiny_config("apertus1p5")
    vocab = cfg.text_config.vocab_size
    assert vocab == cov.VOCAB
    assert cfg.image_token_offset + cfg.vision_config.codebook_size == cfg.audio_token_offset
    assert cfg.audio_token_offset + cfg.audio_config.codebook_size <= vocab
    ranges = set(range(cfg.image_token_offset, cfg.audio_token_offset + cfg.audio_config.codebook_size))
    assert not ranges & {cfg.image_token_id, cfg.audio_token_id, cfg.text_config.pad_token_id}
