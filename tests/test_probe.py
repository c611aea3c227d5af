"""tests/probe_bad_input.py: every bad input of issue 60 is one line and a non-zero exit, creating nothing and losing
nothing; and a study name is shell-quoted in the commands the end of a run prints."""
from __future__ import annotations

import pathlib
import shlex
import subprocess
import sys


def test_every_bad_input_is_one_line_and_makes_nothing(gguf_file, inject) -> None:
  p = subprocess.run([sys.executable, str(pathlib.Path(__file__).with_name("probe_bad_input.py")),
                      gguf_file("tiny", "q4_0")], capture_output=True, text=True, env=inject(seconds=0.1), timeout=900)
  assert p.returncode == 0, p.stdout + p.stderr


def test_review_hints_quote_the_study_name(gguf_file, tmp_path, inject) -> None:
  name = "a$(touch pwned)"
  argv = ["start", "--model", gguf_file("tiny", "q4_0"), "--study", name, "--storage", f"sqlite:///{tmp_path / 's.db'}",
          "--trials", "1", "--device", "CPU", "--no-prefill", "-n", "6", "--rounds", "1", "--fix", "beam=0",
          "--confirm", "0"]
  p = subprocess.run([sys.executable, "-m", "search", *argv], capture_output=True, text=True, env=inject(seconds=0.1),
                     cwd=tmp_path, timeout=300)
  review = next(ln for ln in p.stdout.splitlines() if ln.startswith("review:"))
  assert f"--study {shlex.quote(name)} " in review and f"--study {name} " not in review, review
