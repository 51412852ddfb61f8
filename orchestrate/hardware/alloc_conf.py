"""The CUDA caching allocator's `expandable_segments` setting a GPU launch runs with.

orchestrate sets `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` for the workers of every GPU
launch, as torchtune does on import unless the variable is set (pytorch/torchtune@bd2a0fc7:
torchtune/__init__.py) and torchtitan's launcher does (pytorch/torchtitan@0168bd51:
run_train.sh, with its newer name PYTORCH_ALLOC_CONF): one growing segment per stream instead of
one cudaMalloc per large request, which removes most fragmentation (c10/cuda/CUDACachingAllocator.cpp,
Note [Expandable Segments]). A user who set either variable keeps their value; the hardware profile
records the setting (`HardwareProfile.expandable_segments`, read in `resolve_hardware`), so the plan's
allocator reserve models what will run, and the launcher passes it to the workers in plan.json's
`run.env`.
"""

from __future__ import annotations

from collections.abc import Mapping

CONF_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
"""torch 2.13 reads PYTORCH_ALLOC_CONF first, PYTORCH_CUDA_ALLOC_CONF "for backward compatibility
... with lower priority" (c10/core/AllocatorConfig.h); older torch reads only the second."""
ORCHESTRATE_VAR = "PYTORCH_CUDA_ALLOC_CONF"
"""What orchestrate sets: the name every torch with expandable segments (2.1 and later) reads."""


def user_alloc_conf(environ: Mapping[str, str]) -> tuple[str, str] | None:
    """(variable, value) of the allocator configuration the user set, the one torch reads first."""
    for var in CONF_VARS:
        if var in environ:
            return var, environ[var]
    return None


def expandable_segments_in(conf: str) -> bool:
    """Whether an allocator configuration string turns expandable segments on (torch's default: off;
    it accepts `True` / `False`, c10/core/AllocatorConfig.cpp `parseExpandableSegments`)."""
    setting = False
    for item in conf.split(","):
        key, _, value = item.partition(":")
        if key.strip() == "expandable_segments":
            setting = value.strip() == "True"
    return setting


def launch_alloc_env(expandable_segments: bool, environ: Mapping[str, str]) -> tuple[dict[str, str], str]:
    """The allocator variable for a GPU launch's workers and why: the user's own, else orchestrate's
    for the setting the plan was made with."""
    user = user_alloc_conf(environ)
    if user is not None:
        var, value = user
        return {var: value}, f"CUDA allocator: {var}={value} from your environment (the plan models it)"
    value = f"expandable_segments:{expandable_segments}"
    why = ("one growing segment per stream, less fragmentation" if expandable_segments
           else "as the hardware profile asks")
    return {ORCHESTRATE_VAR: value}, f"CUDA allocator: {ORCHESTRATE_VAR}={value} ({why}; set it yourself to choose)"
