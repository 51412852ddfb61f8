"""Importing this module registers the built-in backends (one file each)."""

from orchestrate.backends import ddp, deepspeed_backend, fsdp  # noqa: F401
