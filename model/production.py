"""Production configs: the StructureConfig that `search export` chose for a model file, loaded by `model run` and `model
bench` unless --config or --baseline says otherwise (the evaluator never reads them: its baseline is the default
StructureConfig).

They live in $STRUCTSEARCH_HOME/production/<model-name>.toml ($STRUCTSEARCH_HOME defaults to
~/.local/share/structsearch). Each is a plain StructureConfig TOML (any --config accepts it) whose header comment says
where it comes from, names the SHA-256 of the model file it was measured on (it is applied to that file only) and the
workload it was chosen under (model/workload.py: `model run` and `model bench` say when theirs differs)."""
from __future__ import annotations

import os
import pathlib
import re
from dataclasses import dataclass

from model.filehash import file_sha256
from model.presets import UnknownPreset, get_preset
from model.structure import ConfigError, StructureConfig
from model.workload import Workload

SHA_LINE = re.compile(r"^# model-sha256: ([0-9a-f]{64})$", re.M)


def home() -> pathlib.Path:
  return pathlib.Path(os.environ.get("STRUCTSEARCH_HOME", "~/.local/share/structsearch")).expanduser()
def production_dir() -> pathlib.Path: return home() / "production"


def model_key(model: str) -> str:
  """The production file's name for a model given as a name (its preset's name: glm and glm-4.7-flash are one) or a
  .gguf path (its stem)."""
  p = pathlib.Path(model)
  if p.suffix == ".gguf" or os.sep in model: return p.stem
  try: return get_preset(model).name
  except UnknownPreset: return model


def sha_line(sha256: str) -> str: return f"# model-sha256: {sha256}"


@dataclass(frozen=True)
class Production:
  path: pathlib.Path
  config: StructureConfig
  sha256: str | None  # of the model file it was measured on
  summary: str  # its first header line: study, trial, speedup, device
  workload: Workload  # the one it was chosen under (the default where its header names none: exported before)


def read(path: pathlib.Path) -> Production:
  text = path.read_text()
  try: cfg = StructureConfig.from_toml(text)
  except ConfigError as e: raise ConfigError(f"production config {path}: {e}") from None
  sha = m.group(1) if (m := SHA_LINE.search(text)) else None
  return Production(path, cfg, sha, text.splitlines()[0].lstrip("# ") if text.startswith("#") else "",
                    Workload.read(text) or Workload())


def workload_note(chosen: Workload | None, run: Workload) -> str | None:
  """One line where the workload run differs from the one the config was chosen under (None: the same, or a config
  chosen under none: the baseline, a --config file without a workload line)."""
  if chosen is None or chosen == run: return None
  return (f"note: this config was chosen at {chosen}; this run is at {run}: its speed there was not what chose it "
          "(search start --context/--prompt measures a study at this workload)")


def select(model_file: pathlib.Path, model: str, config: str | None,
           baseline: bool) -> tuple[StructureConfig, str, Workload | None]:
  """The config of `model run` / `model bench`, one line saying which and the workload it was chosen under (None: the
  baseline, or a --config file whose header names none): --config, else the baseline with --baseline, else the
  production config measured on this very file (by SHA-256). One named for this model but measured on another file is
  not applied: the line is a warning naming both hashes."""
  if config: return StructureConfig.load(config), f"config: {config} (--config)", Workload.read(open(config).read())
  if baseline: return StructureConfig(), "config: the baseline (--baseline)", None
  d = production_dir()
  if not d.is_dir() or not (files := sorted(d.glob("*.toml"))):
    return StructureConfig(), "config: the baseline (no production config)", None
  sha = file_sha256(model_file)
  named = d / f"{model_key(model)}.toml"
  prods = [read(f) for f in sorted(files, key=lambda f: f != named)]
  if match := next((p for p in prods if p.sha256 == sha), None):
    return (match.config, f"config: production config {match.path} ({match.summary}); --baseline ignores it",
            match.workload)
  if named.exists():
    other = next(p for p in prods if p.path == named)
    return StructureConfig(), (f"warning: {named} was exported for a model file with sha256 "
                               f"{(other.sha256 or 'unknown')[:16]}, not this one ({model_file}, sha256 {sha[:16]}): "
                               "not applied; config: the baseline"), None
  return StructureConfig(), "config: the baseline (no production config for this model file)", None
