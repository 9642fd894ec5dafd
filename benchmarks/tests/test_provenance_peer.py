"""The provenance benchmark's peer glue (:mod:`benchmarks.provenance_peer`), without the kit's venv:
the runner's JSON lines parsed into scores (a failed or missing pair is a reason, never a
number), the peer's table rows and summary, the tokenizer written for the tiny models, and
``--peer-cisco`` refusing a venv it cannot create. Installs nothing; runs no kit.

:data:`CANNED` is a real run's output (``benchmarks/provenance_peer_run.py`` under
cisco-ai-provenance-kit 1.0.0, Python 3.12.1, torch 2.14.1, transformers 5.24.0): pair 0 is a
tiny LLaMA (seed 0) and itself moved by ``random_transform(seed=3)``, pair 1 the same A and an
independent model (seed 1), both saved with :func:`save_checkpoint`; pair 2 is the transformed
pair saved without a tokenizer (the kit fails it); the runner's error line is cut here."""
from __future__ import annotations

import pytest

from benchmarks import provenance_peer as pp

CANNED = """\
{"versions": {"cisco-ai-provenance-kit": "1.0.0", "torch": "2.14.1", "transformers": "5.24.0", "huggingface-hub": "2.4.0", "python": "3.12.1"}}
{"index": 0, "result": {"model_a": "/tmp/pk-try/a", "model_b": "/tmp/pk-try/b", "signals": {"eas": 1.0, "nlf": null, "lep": 0.0, "end": 1.0, "wvc": 0.0, "tfv": 0.925, "voa": 1.0}, "scores": {"mfi_score": 1.0, "mfi_tier": 1, "mfi_match": "exact", "identity_score": 0.5978, "tokenizer_score": 0.9812, "pipeline_score": 1.0, "provenance_decision": "Confirmed Match"}, "interpretation": {"label": "High-Confidence Match", "colour": "#2ecc71"}, "time_seconds": 2.51, "timing": {"total_seconds": 2.51, "metadata_extract_seconds": 1.823, "weight_feature_extract_seconds": 0.686, "cache_hit": "False"}}, "seconds": 2.5140812719982932, "warnings": [], "network": []}
{"index": 1, "result": {"model_a": "/tmp/pk-try/a", "model_b": "/tmp/pk-try/c", "signals": {"eas": 0.4937, "nlf": null, "lep": 0.0, "end": 0.9467, "wvc": 0.0066, "tfv": 0.925, "voa": 1.0}, "scores": {"mfi_score": 1.0, "mfi_tier": 1, "mfi_match": "exact", "identity_score": 0.3902, "tokenizer_score": 0.9812, "pipeline_score": 1.0, "provenance_decision": "Confirmed Match"}, "interpretation": {"label": "High-Confidence Match", "colour": "#2ecc71"}, "time_seconds": 0.724, "timing": {"total_seconds": 0.724, "metadata_extract_seconds": 0.021, "weight_feature_extract_seconds": 0.698, "cache_hit": "False"}}, "seconds": 0.7246918349992484, "warnings": [], "network": []}
{"index": 2, "error": "ExtractionError: Failed to extract base features for '/tmp/pk-try/notok_a': Couldn't instantiate the backend tokenizer from one of: (1) a `tokenizers` library serialization file, ...", "seconds": 0.00834604499686975, "warnings": [], "network": []}
"""


def test_the_runner_output_is_parsed_into_scores_and_reasons():
    versions, rows = pp.parse_output(CANNED, 4, "the runner exited 1: boom")
    assert versions["cisco-ai-provenance-kit"] == pp.VERSION and versions["python"] == "3.12.1"
    copy, indep, notok, missing = rows
    assert (copy["pipeline"], copy["identity"], copy["mfi_tier"], copy["decision"]) == (1.0, 0.5978, 1, "Confirmed Match")
    assert copy["signals"] == {"eas": 1.0, "nlf": None, "lep": 0.0, "end": 1.0, "wvc": 0.0, "tfv": 0.925, "voa": 1.0}
    assert copy["error"] is None and copy["network"] == [] and indep["identity"] == 0.3902
    for r in (notok, missing):  # never a number for a pair the kit did not score
        assert r["pipeline"] is None and r["identity"] is None and set(r["signals"].values()) == {None}
    assert notok["error"].startswith("ExtractionError: Failed to extract base features")
    assert missing["error"] == "not scored: the runner exited 1: boom"


def _rows():
    """Benchmark rows with the canned scores: two nulls, one positive per kind, one unscored."""
    _, (copy, indep, notok, _) = pp.parse_output(CANNED, 4)
    rows = [{"kind": "independent", "a": 0, "label": 0}, {"kind": "independent", "a": 1, "label": 0},
            {"kind": "finetune", "a": 0, "label": 1}, {"kind": "merge", "a": 0, "label": 1},
            {"kind": "merge", "a": 1, "label": 1}, {"kind": "copy", "a": 0, "label": 1}]
    pp.attach(rows, {"pairs": [indep, dict(indep, identity=0.45), copy, dict(copy, identity=0.40), notok, copy]})
    return rows


def test_the_peer_table_scores_only_what_the_kit_scored():
    t = pp.peer_table(_rows(), ("finetune", "merge"))
    pipe, ident = t["cisco"], t["cisco_identity"]
    assert pipe["auc"] == 0.5 and pipe["null_max"] == 1.0 and pipe["tpr_at_fpr0"] == 0.0  # all 1.0: the MFI gate
    assert ident["null_max"] == 0.45 and ident["auc"] == 0.75 and ident["tpr_at_fpr0"] == 0.5
    assert ident["positive_min"] == {"finetune": 0.5978, "merge": 0.40} and ident["unscored"] == 1
    assert t["cisco_eas"]["auc"] == 1.0 and t["cisco_eas"]["null_max"] == 0.4937  # the signal it dilutes
    assert t["signal_means"]["wvc"] == {"null": 0.0066, "positive": 0.0}
    v = t["verdict"]  # its decision: "Confirmed Match" on every scored pair; the failed one is no match
    assert (v["fpr"], v["false_positives"], v["negatives"]) == (1.0, 2, 2) and v["tpr_by_kind"] == {"finetune": 1.0, "merge": 0.5}
    assert v["mfi_tiers"] == [1] and t["signals_absent"] == ["nlf"] and t["network_attempts"] == 0
    assert len(t["failures"]) == 1 and t["failures"][0].startswith("merge (A1): ExtractionError")


def test_the_report_has_the_peer_rows():
    from benchmarks.bench_provenance import KINDS, markdown
    rows = _rows()
    for r in rows:
        r.update(verdict="unrelated", p_value=0.5)
    p = {"name": pp.NAME, "how": pp.HOW, "versions": {"python": "3.12.1", "torch": "2.14.1", "transformers": "5.24.0"},
         "pairs": len(rows), "scores": pp.peer_table(rows, KINDS), "seconds": 12.0, "seconds_kit": 10.0, "seconds_save": 1.0}
    score = {"auc": 1.0, "null_max": 0.1, "positive_min": {k: 0.5 for k in KINDS}, "tpr_at_fpr0": 1.0}
    r = {"commit": "abc", "when": "now", "models": 2, "train_steps": 1, "bases": 1, "finetune_steps": 1, "long_steps": 1,
         "null_copies": 1, "threshold": 0.25, "threads": 1, "rows": rows, "peer_cisco": p,
         "verdict": {"fpr": 0.0, "false_positives": 0, "negatives": 2, "tpr": 1.0, "tpr_by_kind": {k: 1.0 for k in KINDS},
                     "same_on_copies": True, "same_elsewhere": 0},
         "scores": {k: dict(score) for k in ("excess", "statistic", "huref", "raw")},
         "seconds": {"train": 1.0, "calibration": 2.0, "total": 14.0}}
    md = markdown(r)
    assert f"| peer: {pp.NAME} (its own code), pipeline score (its decision's score) | 0.500 | 1.000 |" in md
    assert "n/a / n/a / n/a" in md  # kinds without a scored positive
    assert "its EAS signal alone (embedding anchor self-similarity) | 1.000 | 0.494 |" in md
    assert "Its own decision (Confirmed Match or High-Confidence Match: derived): false-positive rate 1.000 (2/2)" in md
    assert "not computed: nlf" in md and "Pairs the kit could not score (1):" in md and "without the peer" in md


def test_the_tokenizer_written_for_the_tiny_models_loads(tmp_path):
    from transformers import AutoTokenizer
    pp.write_tokenizer(tmp_path, 64)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    assert len(tok.get_vocab()) == 64 and tok.encode("t5 t63 the", add_special_tokens=False) == [5, 63, 0]


def test_peer_cisco_without_a_python_is_an_error_not_an_install(tmp_path, capsys):
    from benchmarks.bench_provenance import main
    with pytest.raises(SystemExit) as e:
        main(["--peer-cisco", "--peer-cisco-venv", str(tmp_path / "venv"), "--peer-cisco-python", str(tmp_path / "nope")])
    assert e.value.code == 2 and "no Python >= 3.12" in capsys.readouterr().err
    assert not (tmp_path / "venv").exists()


def test_a_runner_that_cannot_start_leaves_every_pair_unscored_with_the_reason(tmp_path):
    import sys
    # this interpreter has no kit: the runner exits non-zero before its first line
    res = pp.score_pairs([(tmp_path / "a", tmp_path / "b")] * 2, sys.executable, tmp_path, timeout=120)
    assert res["versions"] == {} and res["returncode"] not in (0, None)
    for row in res["pairs"]:
        assert row["pipeline"] is None and row["error"].startswith("not scored: the kit's runner exited")
        assert "Error" in row["error"]  # the runner's last stderr line: why it stopped
