"""Every merge option is declared once (a field of ``MergeConfig``): its flag, YAML key, default,
help line and docs row are derived from that declaration, and the parser and the YAML reader
are built from it."""
from __future__ import annotations

import pathlib

import pytest

from symgraph.cli.main import build_parser
from symgraph.errors import InputError
from symgraph.app.config import MERGE_KEYS, MergeConfig, defaults, merge_options, read_merge_config
from symgraph.app.options import flag, options, options_page

DOCS = pathlib.Path(__file__).parents[1] / "docs" / "options.md"


def _merge_parser():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return sub.choices["merge"]


def test_every_field_has_a_flag_a_key_a_default_a_help_and_a_docs_row():
    parser = _merge_parser()
    flags = {s: a for a in parser._actions for s in a.option_strings}
    positional = {a.dest for a in parser._actions if not a.option_strings}
    docs = DOCS.read_text()
    fields = MergeConfig.model_fields
    assert set(MERGE_KEYS) == set(fields)  # the YAML keys and what each expects
    assert set(defaults()) == set(fields)
    for o in options(MergeConfig):
        assert o.help and len(o.help) > 15, o.key
        assert f"| `{o.key}` |" in docs, o.key
        if o.flag is None:
            assert o.key in positional, o.key  # models: the positional arguments
            continue
        action = flags[o.flag]
        assert action.dest == o.key and action.default is None and o.help in action.help, o.key
    schema_flags = {o.flag for o in options(MergeConfig) if o.flag}
    assert set(flags) - schema_flags == {"-h", "--help", "--config", "--debug", "--quiet"}  # the last two: every command's


def test_the_docs_page_is_the_generated_one():
    assert DOCS.read_text() == options_page(MergeConfig), \
        "regenerate: python -m symgraph.app.config > docs/options.md"


def _cli(argv):
    return merge_options(vars(_merge_parser().parse_args(argv)))


def test_each_flag_sets_its_field_and_unset_flags_keep_the_config(tmp_path):
    cfg = _cli(["a", "b", "--out", "o", "--align", "activations", "--data", "d.pt", "--no-fold-norms",
                "--weights", "1", "3", "--outputs", "logits", "--sketch", "0", "--repair", "--force"])
    assert (cfg.align, cfg.data, cfg.fold_norms, cfg.weights, cfg.outputs, cfg.repair, cfg.force) == \
        ("activations", "d.pt", False, [1.0, 3.0], ["logits"], True, True)
    (tmp_path / "m.yaml").write_text("models: [a, b]\nout: o\nfold_norms: false\ntol: 0.25\n")
    cfg = _cli(["--config", str(tmp_path / "m.yaml")])
    assert cfg.fold_norms is False and cfg.tol == 0.25 and cfg.align == "weights"  # the config's, then defaults
    cfg = _cli(["--config", str(tmp_path / "m.yaml"), "--tol", "0.5"])
    assert cfg.tol == 0.5  # the flag wins


@pytest.mark.parametrize("key", [k for k in MergeConfig.model_fields if k != "models"])
def test_the_yaml_reader_takes_every_key_and_refuses_its_wrong_type(tmp_path, key):
    (tmp_path / "m.yaml").write_text(f"models: [a, b]\n{key}: [[1], 2]\n")
    with pytest.raises(InputError, match=key):
        read_merge_config(str(tmp_path / "m.yaml"))


def test_refine_never_silently_changes_an_explicit_align():
    with pytest.raises(InputError, match="--refine starts from activation matching.*--align activations"):
        _cli(["a", "b", "--out", "o", "--data", "d.pt", "--refine", "5", "--align", "weights"])
    assert _cli(["a", "b", "--out", "o", "--data", "d.pt", "--refine", "5"]).align == "activations"
    assert flag(MergeConfig, "fold_norms") == "--no-fold-norms"


def test_max_iter_and_until_reach_align_and_are_checked(tmp_path):
    """``--max-iter N`` and ``--until exact|discrete`` (``max_iter:``, ``until:`` in a config) end
    the sweeps of the merge's alignment (passed to ``symgraph.align``, whose defaults they
    share); 0, an unknown rule (argparse's choices on the command line) and either without an alignment are refused, one line each."""
    from symgraph.alignment.options import AlignOptions
    from symgraph.merging.config import solver_options
    cfg = _cli(["a", "b", "--out", "o"])
    assert (cfg.max_iter, cfg.until) == (AlignOptions().max_iter, AlignOptions().until) == (6, "gap")
    cfg = _cli(["a", "b", "--out", "o", "--max-iter", "7", "--until", "discrete"])
    assert (cfg.max_iter, cfg.until) == (7, "discrete")
    assert {k: solver_options(cfg)[k] for k in ("max_iter", "until")} == {"max_iter": 7, "until": "discrete"}
    (tmp_path / "m.yaml").write_text("models: [a, b]\nout: o\nmax_iter: 3\n")
    assert _cli(["--config", str(tmp_path / "m.yaml")]).max_iter == 3
    (tmp_path / "bad.yaml").write_text("models: [a, b]\nout: o\nuntil: never\n")
    with pytest.raises(InputError, match="until"):
        _cli(["--config", str(tmp_path / "bad.yaml")])
    for argv, msg in ((["--max-iter", "0"], "--max-iter 0; expected a number of sweeps"),
                      (["--max-iter", "3", "--align", "none"], "--max-iter ends the sweeps of an alignment"),
                      (["--until", "discrete", "--align", "none"], "--until ends the sweeps of an alignment")):
        with pytest.raises(InputError, match=msg) as e:
            _cli(["a", "b", "--out", "o", *argv])
        assert len(str(e.value).splitlines()) == 1
