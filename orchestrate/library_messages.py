"""Messages from libraries that a user cannot act on, stopped where they are made: one exact message
on one library logger each, so every other warning of that library still shows. Installed when
orchestrate is imported (orchestrate/__init__.py), before any of these libraries is.

- bitsandbytes (0.49+) on a CPU with AVX512-BF16, when imported (peft imports it): "Failed to load CPU
  gemm_4bit_forward from kernels-community" (bitsandbytes/backends/cpu/ops.py): it tries to fetch a
  fused 4-bit kernel from the Hugging Face Hub through the optional `kernels` package. That kernel
  serves only the eval-mode repacked layout, which orchestrate turns off for every NF4 layer
  (orchestrate/methods/lora/transform.py `nf4_linear`), so nothing is missing.
"""

from __future__ import annotations

import logging

_DROPPED = {"bitsandbytes.backends.cpu.ops": "Failed to load CPU gemm_4bit_forward from kernels-community"}


class _DropMessage(logging.Filter):
    def __init__(self, start: str) -> None:
        super().__init__()
        self.start = start

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.start)


def silence_library_messages() -> None:
    for logger, start in _DROPPED.items():
        log = logging.getLogger(logger)
        if not any(isinstance(f, _DropMessage) for f in log.filters):
            log.addFilter(_DropMessage(start))
