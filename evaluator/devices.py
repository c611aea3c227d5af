"""Which physical device a tinygrad device name means: the key of its benchmark lock, and the model name a study is
bound to.

`CUDA`, `CUDA:0` and `NV` name one card (tinygrad's default device is index 0; CUDA and NV are two drivers of the same
NVIDIA cards), so they share one lock. An index is nvidia-smi's, but that CUDA counts only the cards
CUDA_VISIBLE_DEVICES lets it see (on a host of mixed GPU models, CUDA_DEVICE_ORDER=PCI_BUS_ID makes CUDA count in
nvidia-smi's order); nvidia-smi, where present, turns it into the card's UUID and model name. The host's CPU is one
device however it is named."""
from __future__ import annotations

import functools
import os
import platform
import subprocess
from dataclasses import dataclass

NVIDIA = ("CUDA", "NV")


@dataclass(frozen=True)
class PhysicalDevice:
  # one per piece of hardware: "CPU", "nvidia-GPU-<uuid>", "nvidia-<index>" without nvidia-smi, "<KIND>-<index>"
  key: str
  name: str  # its model ("NVIDIA H100 80GB HBM3", the CPU's), "" when unknown


def kind(device: str) -> str: return device.split(":")[0].upper()


def check_device(device: str) -> str:
  """device, if tinygrad has a compute device of its kind (KIND or KIND:INDEX); else ValueError naming those it has."""
  from tinygrad.device import Device  # the names of its runtimes: no device is opened
  kinds = sorted(set(Device._devices) - {"DISK", "NPY", "TINYFS"})
  _, colon, i = device.partition(":")
  if kind(device) not in kinds or (colon and not i.isdigit()):
    raise ValueError(f"{device!r} is not a tinygrad device: KIND or KIND:INDEX, KIND one of {', '.join(kinds)}")
  if kind(device) == "CPU" and index(device) > 0:
    raise ValueError(f"{device!r}: this host has one CPU device, CPU (or CPU:0)")
  if kind(device) in NVIDIA and (gpus := nvidia_gpus()) and index(device) >= (n := len(_visible(device) or gpus)):
    raise ValueError(f"{device!r}: this host has {n} {kind(device)} device{'s' * (n > 1)}, {kind(device)}:0 to "
                     f"{kind(device)}:{n - 1}")
  return device


def index(device: str) -> int:
  """"CUDA:1" -> 1; a name without an index is the driver's default device, 0."""
  _, _, i = device.partition(":")
  return int(i) if i.isdigit() else 0


@functools.cache
def nvidia_gpus() -> tuple[tuple[str, str], ...]:
  """(model name, UUID) of each NVIDIA card by nvidia-smi's index (which CUDA_VISIBLE_DEVICES does not change); ()
  without nvidia-smi."""
  try:
    out = subprocess.run(["nvidia-smi", "--query-gpu=name,uuid", "--format=csv,noheader"], capture_output=True,
                         text=True, timeout=30)
  except (OSError, subprocess.TimeoutExpired): return ()
  if out.returncode != 0: return ()
  rows = (line.rpartition(",") for line in out.stdout.splitlines() if "," in line)
  return tuple((name.strip(), uuid.strip()) for name, _, uuid in rows)


@functools.cache
def nvidia_memory() -> dict[str, int]:
  """Each NVIDIA card's memory in bytes, by UUID ({} without nvidia-smi)."""
  try:
    out = subprocess.run(["nvidia-smi", "--query-gpu=uuid,memory.total", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=30)
  except (OSError, subprocess.TimeoutExpired): return {}
  rows = (line.split(",") for line in out.stdout.splitlines() if out.returncode == 0 and "," in line)
  return {uuid.strip(): int(float(mib)) << 20 for uuid, mib in rows if mib.strip().replace(".", "").isdigit()}


def _visible(device: str) -> list[str]:
  """The cards CUDA_VISIBLE_DEVICES leaves a CUDA device ([]: all of them)."""
  if kind(device) != "CUDA": return []
  return [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]


def physical(device: str) -> PhysicalDevice:
  k, i = kind(device), index(device)
  if k == "CPU": return PhysicalDevice("CPU", platform.processor() or platform.machine())
  if k not in NVIDIA: return PhysicalDevice(f"{k}-{i}", "")
  visible = _visible(device)
  card = visible[i] if i < len(visible) else str(i)
  gpus = nvidia_gpus()
  for n, (name, uuid) in enumerate(gpus):
    if card in (str(n), uuid) or (card.startswith("GPU-") and uuid.startswith(card)):
      return PhysicalDevice(f"nvidia-{uuid}", name)
  return PhysicalDevice(f"nvidia-{card}", "")
