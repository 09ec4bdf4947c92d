"""The command line streams an answer from the offline model."""
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_cli_generate_streams_an_answer_with_the_chat_template(smollm2_dir):
    out = subprocess.run([sys.executable, "-m", "minikv.cli", "generate", "--model", "smollm2-135m",
                          "--prompt", "What is the capital of France?", "--max-tokens", "12"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout


def test_cli_reports_bad_input_as_an_error_line():
    out = subprocess.run([sys.executable, "-m", "minikv.cli", "generate", "--model", "tiny-random",
                          "--prompt", "hi", "--max-tokens", "0"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "error: max_tokens must be an integer >= 1" in out.stderr


def test_cli_help_lists_the_classroom_verbs(capsys):
    from minikv.cli import main

    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    for verb in ("check", "grade", "release"):
        assert f"minikv {verb}" in out and f"    {verb} " in out, verb


def test_cli_release_says_what_to_write(capsys):
    from minikv.cli import main

    assert main(["release"]) == 2
    assert "--student OUT" in capsys.readouterr().err
