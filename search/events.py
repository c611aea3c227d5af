"""What a worker tells its listeners (the CLI attaches the live view and the dashboard's artifact uploader)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from db.models import Trial


@dataclass
class Event:
  """A trial started, changed phase, waits for a device or other workers, ended (with its finished row); configs were
  measured again (the baseline between trials, the near-best before the end: their estimates changed, and with the
  baseline's or the noise figure every speedup and interval); or a note."""
  kind: str  # start | phase | wait | end | measured | note
  number: int
  text: str = ""
  row: Trial | None = None


Listener = Callable[[Event], None]
