"""What a worker tells its listeners (the CLI attaches the live view and the dashboard's artifact uploader)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from db.models import Trial


@dataclass
class Event:
  """A trial started, changed phase, waits for a device or other workers, ended (with its finished row); or a note."""
  kind: str  # start | phase | wait | end | note
  number: int
  text: str = ""
  row: Trial | None = None


Listener = Callable[[Event], None]
