"""scripts/setup.sh says what it does (issue 27 item 17): pip is not quieted, and every step that can take
more than a few seconds (pip, provisioning) is announced, with the time so far, before it runs."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

SETUP = Path(__file__).resolve().parent.parent / "scripts" / "setup.sh"


def test_setup_does_not_quiet_pip_and_announces_every_long_step():
    text = SETUP.read_text()
    [pip] = [line for line in text.splitlines() if line.startswith("PIP=(")]
    assert not re.search(r"\s(-q|--quiet)\b", pip), pip
    lines = [line.strip() for line in text.splitlines()]
    long_steps = [
        i
        for i, line in enumerate(lines)
        if line.startswith('"${PIP[@]}"') or ("provision()" in line or "minilm_model_dir()" in line)
    ]
    assert len(long_steps) == 6  # torch (GPU or CPU), kvmem, uninstalls, the model, the embedder
    for i in long_steps:
        before = [
            line for line in lines[:i] if line and not line.startswith(("if ", "for ", "else", "fi", "do"))
        ]
        assert before[-1].startswith('step "'), (lines[i], before[-1])


def test_the_step_line_says_the_seconds_so_far():
    body = next(line for line in SETUP.read_text().splitlines() if line.startswith("step()"))
    out = subprocess.run(
        ["bash", "-c", f'STARTED=$SECONDS; {body}; step "installing"'],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stderr == "setup: [0 s] installing\n"


def test_the_pip_command_line_runs():
    """The PIP array's options are pip's general options (an install option before the subcommand, e.g.
    --progress-bar, makes every pip call fail: CI's fresh set-up did)."""
    [pip] = [line for line in SETUP.read_text().splitlines() if line.startswith("PIP=(")]
    venv = Path(__file__).resolve().parent.parent / ".venv"
    out = subprocess.run(
        ["bash", "-c", f'VENV="{venv}"; {pip}; "${{PIP[@]}}" --version'], capture_output=True, text=True
    )
    assert out.returncode == 0 and out.stdout.startswith("pip "), out.stderr
