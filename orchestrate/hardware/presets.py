"""Named hardware presets (`launch_configs/profiles/<name>.yaml`) and profile files of the same shape.

Every GPU preset follows these conventions (each file cites its spec sources):
- `memory_bytes` is what the card reports (8192 MiB on the 8 GB cards), not the marketing 8e9 bytes.
- `peak_tflops_fp16` / `peak_tflops_bf16` are dense tensor-core peaks with fp32 accumulate, the mode
  mixed-precision training uses. GeForce cards run it at half their fp16-accumulate rate (NVIDIA's
  Turing, Ampere GA102 and Ada whitepapers list both), so these are half the headline tensor figures.
  Turing (compute capability 7.5) has no bf16: 0. Clocks are the reference boost clocks.
- `p2p: false`: GeForce drivers do not enable PCIe peer-to-peer; NCCL copies through host memory.
  `nvlink: false` everywhere: of the 8 GB cards only the RTX 2080 (and 2070 Super) takes a bridge,
  and whoever has one fitted writes their own profile file.
- Host side: one node, one GPU, 8 physical cores, 64 GiB RAM; NVMe keeps the `HardwareProfile`
  defaults (never measured).

The presets are read from the source tree; a wheel would need them as package data.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path

from pydantic import ValidationError

from orchestrate.config import safe_yaml
from orchestrate.errors import Problem, UserError
from orchestrate.hardware.profile import HardwareProfile

PRESET_DIR = Path(__file__).resolve().parents[2] / "launch_configs" / "profiles"


def list_presets() -> list[str]:
    return sorted(path.stem for path in PRESET_DIR.glob("*.yaml"))


def load_preset(name: str) -> HardwareProfile:
    """The preset `name`; its `name` field is the preset name."""
    known = list_presets()
    if name not in known:
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        raise UserError(f"unknown hardware preset {name!r}", [Problem(
            "--profile", f"no preset named {name!r}",
            f"{hint}known presets: {', '.join(known)}; or pass the path of a profile YAML file")])
    return load_profile_file(PRESET_DIR / f"{name}.yaml", where="--profile", default_name=name)


def load_profile(spec: str) -> HardwareProfile:
    """`--profile` accepts a preset name or the path of a profile YAML file."""
    path = Path(spec).expanduser()
    if path.suffix in (".yaml", ".yml") or len(path.parts) > 1 or path.is_file():
        return load_profile_file(path, where="--profile", default_name=path.stem)
    return load_preset(spec)


def load_profile_file(path: Path, where: str, default_name: str) -> HardwareProfile:
    """A `HardwareProfile` YAML file; without a `name:` key the profile is called `default_name`."""
    label = f"{where} {path}"
    data, _ = safe_yaml.load_file(path, label)  # size, depth, alias, duplicate-key and UTF-8 checks
    if not isinstance(data, dict):
        raise UserError("invalid hardware profile", [Problem(label, "expected a mapping of profile fields",
                                                             "`orchestrate profile --yaml` prints one of the right shape")])
    data.setdefault("name", default_name)
    try:
        return HardwareProfile.model_validate(data)
    except ValidationError as exc:
        problems = [Problem(f"{label}: {'.'.join(str(p) for p in err['loc']) or '(top level)'}", err["msg"],
                            "compare with a preset file in launch_configs/profiles/")
                    for err in exc.errors()]
        raise UserError("invalid hardware profile", problems) from exc


def _gpu_key(name: str) -> str:
    """"NVIDIA GeForce RTX 3060 Ti" and "GeForce RTX 3060 Ti" (older drivers) -> "rtx3060ti"."""
    key = re.sub(r"[^a-z0-9]", "", name.lower())
    return re.sub(r"^(nvidia)?(geforce)?", "", key)


def preset_for_gpu(gpu_name: str) -> str | None:
    """The preset whose GPU has exactly this name (vendor prefixes aside); laptop, Super and Ti
    variants differ in name and clocks, so they match nothing rather than a wrong card."""
    key = _gpu_key(gpu_name)
    for name in list_presets():
        gpu = load_preset(name).gpu
        if gpu is not None and _gpu_key(gpu.name) == key:
            return name
    return None
