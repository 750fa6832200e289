"""`kvmem --help` and `kvmem serve --help`: every flag described with its default, auth on by default said,
provision described, distill's exit codes and expected time given."""

from __future__ import annotations

import argparse

import pytest

from serving.ops.cli import add_serve_arguments, main


def _serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvmem serve", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_serve_arguments(p)
    return p


def _help(argv: list[str], capsys: pytest.CaptureFixture) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 0
    return " ".join(capsys.readouterr().out.split())  # argparse wraps lines: compare on single spaces


def test_every_serve_flag_has_a_help_text() -> None:
    undescribed = [a.option_strings[0] for a in _serve_parser()._actions if not a.help]
    assert undescribed == []


def test_serve_help_shows_defaults_and_says_auth_is_on(capsys: pytest.CaptureFixture) -> None:
    text = _help(["serve", "--help"], capsys)
    assert "Auth is on by default" in text and "auth is ON by default" in text
    for flag, default in [
        ("--host HOST", "127.0.0.1"),
        ("--port PORT", "8000"),
        ("--data-dir DATA_DIR", ".kvmem"),
        ("--queue-size QUEUE_SIZE", "16"),
        ("--extractor-timeout-s EXTRACTOR_TIMEOUT_S", "30.0"),
        ("--log-level", "info"),
    ]:
        after = text.split("options:", 1)[1].split(f" {flag} ", 1)[1]
        shown = after.split(" --", 1)[0]  # this flag's help, up to the next flag
        assert f"(default: {default})" in shown, (flag, shown)


def test_top_level_help_describes_provision_and_distill(capsys: pytest.CaptureFixture) -> None:
    text = _help(["--help"], capsys)
    assert "auth on by default" in text
    assert "exit 0 activated, 3 not activated" in text and "expect minutes on CPU" in text
    provision = _help(["provision", "--help"], capsys)
    assert "Idempotent" in provision and "Exit 0 ready, 1 failed" in provision
