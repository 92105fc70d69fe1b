"""Classify an exception raised by a SageAttention kernel call."""

from __future__ import annotations

import enum

import torch


class Failure(enum.Enum):
    OUT_OF_MEMORY = "oom"  # transient: this scope moves to PyTorch, the next one tries again
    CACHE = "cache"  # Triton cache write race (OSError): this call falls back
    BROKEN = "broken"  # anything else: the device is retired


def is_out_of_memory(error: BaseException) -> bool:
    # Triton raises a plain RuntimeError("Triton Error [CUDA]: out of memory").
    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and "out of memory" in str(error)
    )


def classify(error: BaseException) -> Failure:
    if is_out_of_memory(error):
        return Failure.OUT_OF_MEMORY
    if isinstance(error, OSError):
        return Failure.CACHE
    return Failure.BROKEN
