"""Shared fixtures: synthetic GGUF files, written once per test session."""
from __future__ import annotations

import pytest

from model.synth import write_synthetic


@pytest.fixture(scope="session")
def gguf_file(tmp_path_factory):
  cache: dict[tuple[str, str, bool], str] = {}
  def get(preset: str, quant: str, legacy: bool = False) -> str:
    if (key := (preset, quant, legacy)) not in cache:
      path = tmp_path_factory.mktemp("ref") / f"{preset}-{quant}{'-legacy' if legacy else ''}.gguf"
      cache[key] = str(write_synthetic(path, preset, quant=quant, legacy_kv_b=legacy))
    return cache[key]
  return get
