"""Model names -> GGUF paths.

Real files come from a user config, `$STRUCTSEARCH_MODELS` or `~/.config/structsearch/models.toml`:

    [models]
    glm = "/data/GLM-4.7-Flash-Q4_0.gguf"
    deepseek-v2-lite = "/data/DeepSeek-V2-Lite-Q4_0.gguf"

`tiny` and `tiny-lite` are synthesised on first use into `$STRUCTSEARCH_CACHE` (default `~/.cache/structsearch`).
"""
from __future__ import annotations

import os
import pathlib
import tomllib

from model.presets import PRESETS, get_preset
from model.synth import write_synthetic

SYNTHESISED = ("tiny", "tiny-lite")


class ModelNotFound(ValueError):
  pass


def config_path() -> pathlib.Path:
  return pathlib.Path(os.environ.get("STRUCTSEARCH_MODELS", "~/.config/structsearch/models.toml")).expanduser()


def cache_dir() -> pathlib.Path:
  return pathlib.Path(os.environ.get("STRUCTSEARCH_CACHE", "~/.cache/structsearch")).expanduser()


def configured_models() -> dict[str, str]:
  path = config_path()
  if not path.exists(): return {}
  try: models = tomllib.loads(path.read_text()).get("models", {})
  except tomllib.TOMLDecodeError as e: raise ModelNotFound(f"{path} is not valid TOML: {e}") from None
  if not isinstance(models, dict): raise ModelNotFound(f"{path}: [models] must be a table of name = \"path\"")
  return {str(k): str(v) for k, v in models.items()}


def resolve(name_or_path: str) -> pathlib.Path:
  """A model name (or alias) or a path to a GGUF file -> an existing GGUF path."""
  as_path = pathlib.Path(name_or_path).expanduser()
  if as_path.suffix == ".gguf" or os.sep in name_or_path:
    if not as_path.is_file(): raise ModelNotFound(f"no GGUF file at {as_path}")
    return as_path
  try: preset = get_preset(name_or_path)
  except ValueError: preset = None
  configured = configured_models()
  for key in [name_or_path] + ([preset.name, *preset.aliases] if preset else []):
    if key in configured:
      path = pathlib.Path(configured[key]).expanduser()
      if not path.is_file(): raise ModelNotFound(f"{config_path()} maps {key} to {path}, which does not exist")
      return path
  if preset is None:
    raise ModelNotFound(f"unknown model {name_or_path!r}: use one of {', '.join(PRESETS)}, a name from "
                        f"{config_path()}, or a .gguf path")
  if preset.name in SYNTHESISED:
    path = cache_dir() / f"{preset.name}-q4_0.gguf"
    if not path.exists():
      path.parent.mkdir(parents=True, exist_ok=True)
      tmp = path.with_suffix(".tmp")
      write_synthetic(tmp, preset.name, quant="q4_0", seed=0)
      tmp.replace(path)
    return path
  raise ModelNotFound(f"model {preset.name!r} has no file: download the real GGUF ({preset.url}) and add "
                      f"`{preset.name} = \"/path/file.gguf\"` under [models] in {config_path()}, or make a "
                      f"shape-identical synthetic one with `model synth --preset {preset.name} --out "
                      f"{preset.name}.gguf` and pass its path")
