"""The model's user-facing errors (imported by the loader, the config, the backends and the CLIs alike)."""


class ConfigError(ValueError):
  """A StructureConfig that is malformed, names an unknown field or value, or combines options that cannot work
  together."""
