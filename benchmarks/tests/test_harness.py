"""The benchmarks' shared subprocess steps (:func:`benchmarks.harness.run_logged`): commands run
in order into one log until one fails, as a peer's venv is made."""
from __future__ import annotations

import sys

import pytest

from benchmarks import provenance_peer
from benchmarks.harness import run_logged


def test_commands_run_in_order_into_the_log_until_one_fails(tmp_path):
    log = tmp_path / "install.log"
    ok = [[sys.executable, "-c", "print('one')"], [sys.executable, "-c", "print('two')"]]
    assert run_logged(ok, log) is None
    text = log.read_text()
    assert text.index("one") < text.index("two") and text.count("$ " + sys.executable) == 2
    fail = [sys.executable, "-c", "import sys; print('bad', file=sys.stderr); sys.exit(3)"]
    assert run_logged([ok[0], fail, ok[1]], log) == fail
    text = log.read_text()   # rewritten: this run's steps only, stderr too, none after the failure
    assert "one" in text and "bad" in text and "two" not in text


def test_a_peer_venv_that_cannot_be_made_is_one_line_naming_its_log(tmp_path):
    venv = tmp_path / "venv"
    with pytest.raises(provenance_peer.PeerError, match=r"could not create the kit's venv: venv .* failed "
                       r"\(see .*venv-install\.log\)") as e:
        provenance_peer.ensure_venv(venv, python="/bin/false", log=lambda m: None)
    assert "\n" not in str(e.value) and (tmp_path / "venv-install.log").is_file()
