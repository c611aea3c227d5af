"""Test-only: Python runs this at the start of every process whose PYTHONPATH holds this directory (the tests put it
there for the `search` and trial processes they start). It installs the faults and fakes that $STRUCTSEARCH_FAULT and
$STRUCTSEARCH_FAKE_TRIALS name (tests/inject/trialfakes.py); with neither set it does nothing."""
import os

if os.environ.get("STRUCTSEARCH_FAULT") or os.environ.get("STRUCTSEARCH_FAKE_TRIALS"):
  import trialfakes
  trialfakes.install_from_env()
