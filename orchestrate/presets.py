"""Ready-made backend configs in launch_configs/, generated from hardware profiles and examples.

Users who keep their own training scripts can take e.g. `launch_configs/zero3-offload-2x8gb/
deepspeed.json` as is. The files are never edited by hand: `python -m orchestrate.presets`
regenerates them, and a test proves regenerating gives the same bytes.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from orchestrate.backends.accelerate_export import render_accelerate_config
from orchestrate.backends.registry import get_backend
from orchestrate.config.load import load_config
from orchestrate.hardware.resolve import resolve_hardware
from orchestrate.hardware.units import GiB, format_bytes
from orchestrate.planning import feasible_plan
from orchestrate.run.layout import ACCELERATE_FILE

REPO = Path(__file__).resolve().parents[1]
LAUNCH_CONFIGS = REPO / "launch_configs"


@dataclass(frozen=True)
class Preset:
    name: str
    profile: str
    """A hardware preset in launch_configs/profiles/."""
    gpus: int
    example: str
    """A model.yaml in examples/ whose model and batch settings the preset is planned for."""
    pins: dict[str, object] = field(default_factory=dict)
    """Config overrides (dotted paths) that pin the strategy the preset demonstrates."""


PRESETS = (
    Preset("zero2-offload-1x8gb", "generic-8gb", 1, "gpt2-xl.yaml",
           {"strategy.backend": "deepspeed", "strategy.zero_stage": 2, "strategy.offload": "cpu"}),
    Preset("zero3-offload-2x8gb", "generic-8gb", 2, "llama-1.1b.yaml",
           {"strategy.backend": "deepspeed", "strategy.zero_stage": 3, "strategy.offload": "cpu",
            "strategy.offload_params": True}),
    Preset("zero3-offload-2x8gb-turing", "rtx2070", 2, "llama-1.1b.yaml",
           {"strategy.backend": "deepspeed", "strategy.zero_stage": 3, "strategy.offload": "cpu",
            "strategy.offload_params": True}),
    Preset("fsdp2-2x8gb", "generic-8gb", 2, "gpt2-xl.yaml",
           {"strategy.backend": "fsdp", "strategy.zero_stage": 3, "strategy.offload": "cpu",
            "strategy.offload_params": True}),
)


def render_preset(preset: Preset, out_dir_for_links: str) -> dict[str, str]:
    """The files of one preset, name -> text. `out_dir_for_links` is how files refer to each other
    (a path relative to the repository, so the bytes do not depend on where the repo lives)."""
    overrides = [f"{k}={v}" for k, v in preset.pins.items()]
    config = load_config(REPO / "examples" / preset.example, overrides)
    # The allocator setting orchestrate launches with, whatever this shell's PYTORCH_*ALLOC_CONF says.
    hardware = resolve_hardware(profile=preset.profile, gpus=preset.gpus, environ={})
    plan = feasible_plan(config, hardware)
    chosen = plan.chosen
    files = dict(get_backend(chosen.strategy.backend).render(plan))
    files[ACCELERATE_FILE] = render_accelerate_config(plan, out_dir_for_links)
    summary = {
        "preset": preset.name,
        "generated_by": "python -m orchestrate.presets",
        "model": f"examples/{preset.example}",
        "hardware": f"{preset.gpus} x {hardware.gpu.name} ({preset.profile}), "
                    f"{format_bytes(hardware.cpu_memory_bytes, digits=0)} RAM",
        "strategy": chosen.name,
        "gradient_accumulation": chosen.gradient_accumulation,
        "predicted_gpu_gib_per_rank": round(chosen.memory.gpu_total / GiB, 2),
        "predicted_cpu_gib_per_node": round(chosen.memory.cpu_total / GiB, 2),
        "seq_len": config.train.seq_len,
        "global_batch_size": config.train.global_batch_size,
    }
    files["preset.yaml"] = yaml.safe_dump(summary, sort_keys=False)
    return files


def generate(root: Path = LAUNCH_CONFIGS) -> list[Path]:
    written = []
    for preset in PRESETS:
        target = root / preset.name
        target.mkdir(parents=True, exist_ok=True)
        for name, text in render_preset(preset, f"launch_configs/{preset.name}").items():
            (target / name).write_text(text)
            written.append(target / name)
    return written


if __name__ == "__main__":
    for path in generate():
        print(path.relative_to(REPO))
    sys.exit(0)
