"""The Python API behind every CLI command: plan, config, prepare, launch, slurm, export, profile.

`cli.py` only parses flags, calls these functions and prints. Everything here is callable and
testable without a subprocess. Importing this module is cheap (`orchestrate --help` stays fast):
each function imports the package's modules it needs (one command does not load another's).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrate.hardware.flags import HardwareFlags
from orchestrate.run.layout import PLAN_FILE

if TYPE_CHECKING:
    from rich.console import Console

    from orchestrate.config.schema import RunConfig
    from orchestrate.hardware.profile import HardwareProfile
    from orchestrate.launch.session import LaunchRequest, LaunchResult, Transport
    from orchestrate.launch.torchrun_args import LaunchOptions
    from orchestrate.planner.plan import Refusal, RunPlan
    from orchestrate.transports.slurm.transport import PreparedJob, SlurmOptions
    from orchestrate.transports.ssh.hosts import SshOptions

__all__ = ["CONFIG_TARGETS", "HardwareFlags", "chat_model", "chat_reply",
           "choose_transport", "describe_schema", "export", "hardware_presets", "is_runnable",
           "launch", "launch_options", "launch_request", "load_config", "plan_for", "plan_from_file", "prepare", "prepare_slurm",
           "profile", "profile_table", "profile_yaml", "render_plan", "report", "require_feasible", "slurm_options",
           "slurm_submit", "slurm_test_only", "ssh_options", "train_tokenizer", "verify", "write_config", "write_plan", "write_profile"]


# --- plan and config -----------------------------------------------------------------------------


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> RunConfig:
    """Load, override (`dotted.path=value`) and validate a model.yaml; UserError listing every problem."""
    from orchestrate.config.load import load_config as load

    return load(path, list(overrides))


def plan_for(config: RunConfig, hardware: HardwareProfile) -> RunPlan | Refusal:
    """Plan a validated config on a hardware profile: the runnable plan, or the Refusal when nothing fits."""
    from orchestrate.planning import plan_for as plan

    return plan(config, hardware)


def plan_from_file(config_path: str | Path, overrides: Sequence[str] = (),
                   hardware: HardwareFlags | HardwareProfile = HardwareFlags()) -> RunPlan | Refusal:
    """`orchestrate plan` without the printing: load + override + validate, resolve hardware, plan."""
    from orchestrate.hardware.profile import HardwareProfile
    from orchestrate.model.meta import shape_for
    from orchestrate.planning import check_seq_len, plan_with_shape

    config = load_config(config_path, overrides)
    profile = hardware if isinstance(hardware, HardwareProfile) else hardware.resolve()
    # `launch` and `config` report this with the data's problems (check_data_config); a plan has no data check.
    shape = shape_for(config)
    check_seq_len(config, shape)
    return plan_with_shape(config, profile, shape)


def is_runnable(plan: RunPlan | Refusal) -> bool:
    """Whether the planner chose a strategy (a RunPlan) rather than refused (nothing fits)."""
    from orchestrate.planner.plan import RunPlan

    return isinstance(plan, RunPlan)


def write_plan(plan: RunPlan | Refusal, out: Path) -> Path:
    """`plan --out DIR`: DIR/plan.json (never over files orchestrate did not write, nor into a
    run with checkpoints); returns the file."""
    from orchestrate.launch.rundir import write_plan_dir

    return write_plan_dir(plan, Path(out))


def require_feasible(plan: RunPlan | Refusal) -> None:
    """UserError (what does not fit, by how much, what would) unless the plan chose a strategy."""
    from orchestrate.planning import require_feasible as require

    require(plan)


def render_plan(plan: RunPlan | Refusal, console: Console | None = None) -> dict[str, Any]:
    """The plan as plan.json's public JSON (docs/plan-json.md); with `console`, also printed as tables."""
    from orchestrate.planner.report import plan_json, print_plan
    from orchestrate.planning import method_reports

    reports = method_reports(plan)
    if console is not None:
        print_plan(plan, console, reports)
    return plan_json(plan, reports)


def verify(plan: RunPlan) -> str:
    """`plan --simulate`: the chosen plan run on fake tensors, set against the analytical estimate."""
    from orchestrate.simulate import verify_plan

    return verify_plan(plan).summary()


CONFIG_TARGETS = ("hf-trainer",)
"""Tools `write_config(..., for_tool=...)` can also write files for (`orchestrate config --for`)."""


def write_config(config: RunConfig, hardware: HardwareFlags | HardwareProfile, out: Path,
                 name: str = "run", force: bool = False, for_tool: str | None = None) -> RunPlan:
    """`orchestrate config`: the run directory `launch` would write (the same plan, data,
    existing-checkpoint and overwrite checks, the lock), without starting anything. Returns the
    plan with its files. With `for_tool="hf-trainer"` also the DeepSpeed config a stock HF Trainer
    takes as it is and the TrainingArguments values that train like the plan
    (`orchestrate.backends.hf_trainer_render`); a plan that did not choose DeepSpeed is refused
    before anything is written."""
    from orchestrate.errors import Problem, UserError
    from orchestrate.hardware.profile import HardwareProfile
    from orchestrate.launch.rundir import prepare_run_dir

    if for_tool is not None and for_tool not in CONFIG_TARGETS:
        raise UserError("unknown --for target", [Problem(
            "--for", f"{for_tool!r} is not a tool orchestrate writes configs for", f"use one of {', '.join(CONFIG_TARGETS)}")])
    check = None
    if for_tool is not None:
        from orchestrate.backends import hf_trainer_render as target

        check = target.check_plan
    profile = hardware if isinstance(hardware, HardwareProfile) else hardware.resolve()
    plan, run_dir = prepare_run_dir(config, profile, name, Path(out), resume=False, say=lambda _text: None,
                                    check=check, force=force, where="--out")
    if for_tool is not None:
        for file_name, text in target.render(plan).items():
            (run_dir / file_name).write_text(text)
            plan.files.tools[f"{for_tool}:{file_name}"] = file_name
        plan.write(run_dir / PLAN_FILE)  # plan.json lists the extra files too
    return plan


def prepare(config: RunConfig, *, force: bool = False, progress: bool = True) -> str:
    """`orchestrate prepare`: tokenise the config's data into the shared cache; a summary line."""
    from orchestrate.data.pipeline import prepare_from_config
    from orchestrate.methods.registry import method_data

    return prepare_from_config(config, method_data(config), progress=progress, force=force)


def train_tokenizer(config: RunConfig, vocab_size: int, out: Path) -> tuple[Path, int]:
    from orchestrate.data.tokenizer_train import train_tokenizer as train

    return train(config, vocab_size, Path(out))


# --- launch --------------------------------------------------------------------------------------


def launch_options(**kwargs: Any) -> LaunchOptions:
    """torchrun's rendezvous and restart options (`launch`'s --master-addr, --master-port, --rdzv-*,
    --node-rank), as keywords; each left out is orchestrate's default."""
    from orchestrate.launch.torchrun_args import LaunchOptions

    return LaunchOptions(**kwargs)


def ssh_options(**kwargs: Any) -> SshOptions:
    from orchestrate.transports.ssh.hosts import SshOptions

    return SshOptions(**kwargs)


def choose_transport(*, hosts: Path | None = None, ssh: SshOptions | None = None,
                     options: LaunchOptions | None = None, python: str | None = None,
                     name: str = "orchestrate", program: Sequence[str] = ()) -> Transport:
    """Where the workers start: over SSH on the hostfile's hosts; else with srun inside a SLURM
    allocation (unless `options` give a hand-made rendezvous, or this is already a job step); else
    here. `program`: the user's own training program (`launch -- python train.py ARGS`), torchrun here only."""
    python = python or sys.executable
    options = options or launch_options()
    if program:
        return _own_program_transport(tuple(program), hosts, options)
    if hosts is not None:
        from orchestrate.transports.ssh.hosts import load_hostfile
        from orchestrate.transports.ssh.transport import SshHosts, reject_with_hosts

        reject_with_hosts(options)
        return SshHosts(load_hostfile(Path(hosts)), ssh or ssh_options(), python, options.master_port)
    from orchestrate.transports.slurm.transport import SrunInAllocation, allocation_to_use

    alloc = allocation_to_use(explicit_rendezvous=bool(options.hand_made_rendezvous))
    if alloc is not None:
        return SrunInAllocation(alloc, python, name)
    from orchestrate.transports.local.transport import LocalTorchrun

    return LocalTorchrun(options)


def _own_program_transport(program: tuple[str, ...], hosts: Path | None, options: LaunchOptions) -> Transport:
    from orchestrate.errors import Problem, UserError
    from orchestrate.launch.user_program import user_program
    from orchestrate.transports.local.transport import LocalTorchrun
    from orchestrate.transports.slurm.transport import allocation_to_use

    if hosts is not None or allocation_to_use(explicit_rendezvous=bool(options.hand_made_rendezvous)) is not None:
        raise UserError("your own training program runs with torchrun on this machine only (for now)", [Problem(
            "--hosts" if hosts is not None else "SLURM allocation", "`-- PROGRAM` is not passed to srun or SSH yet",
            "start `orchestrate launch ... --rdzv-endpoint HOST:PORT -- PROGRAM` on each node by hand "
            "(or --master-addr with --node-rank), or run it outside the allocation")])
    return LocalTorchrun(dataclasses.replace(options, program=user_program(program)))


def launch(request: LaunchRequest, transport: Transport | None = None, console: Console | None = None
           ) -> LaunchResult:
    """Plan, write the run directory and run the workers (default: torchrun here, running
    `request.program` when it names one) until they end."""
    from orchestrate.launch.session import launch as run
    from orchestrate.transports.local.transport import LocalTorchrun

    if transport is None:
        transport = choose_transport(program=request.program) if request.program else LocalTorchrun()
    return run(request, transport, console)


def launch_request(config: RunConfig, hardware: HardwareFlags | HardwareProfile = HardwareFlags(),
                   **kwargs: Any) -> LaunchRequest:
    """A LaunchRequest (name, run_dir, resume, dry_run, max_restarts, force, program as keywords)."""
    from orchestrate.launch.session import LaunchRequest

    return LaunchRequest(config, hardware, **kwargs)


# --- SLURM batch jobs ----------------------------------------------------------------------------


def slurm_options(**kwargs: Any) -> SlurmOptions:
    from orchestrate.transports.slurm.transport import SlurmOptions

    return SlurmOptions(**kwargs)


def prepare_slurm(config: RunConfig, flags: HardwareFlags, *, console: Console | None = None,
                  **kwargs: Any) -> PreparedJob:
    """`orchestrate slurm`: plan, write the run directory and RUN_DIR/job.sbatch; submit nothing."""
    from orchestrate.transports.slurm.transport import prepare_slurm_job

    return prepare_slurm_job(config, flags, console=console, **kwargs)


def slurm_test_only(script: Path) -> str:
    from orchestrate.transports.slurm import cluster as slurm_cluster

    return slurm_cluster.test_only(script)


def slurm_submit(script: Path) -> str:
    from orchestrate.transports.slurm import cluster as slurm_cluster

    return slurm_cluster.submit(script)


def report(run_dirs: Sequence[Path], out: Path | None = None) -> Any:
    """`orchestrate report`: PNG plots and summary.md for one or more runs, overlaid."""
    from orchestrate.report.summary import write_report

    return write_report([Path(d) for d in run_dirs], out)


# --- chat ----------------------------------------------------------------------------------------


def chat_model(run_dir: Path, adapter: bool | None = None, template: bool | None = None,
               system: str | None = None) -> Any:
    """`orchestrate chat`: the run's RUN_DIR/model, or (adapter) its base + RUN_DIR/adapter, with the saved
    tokenizer and chat template; `template` renders prompts with the chat template (True) or raw (False),
    None as the run rendered its records; `system` the system prompt in front of the conversation, None
    the run's data.system_prompt, '' none (orchestrate/chat.py)."""
    from orchestrate.chat import load_chat_model

    return load_chat_model(Path(run_dir), adapter, template, system)


def chat_reply(model: Any, messages: list[dict[str, str]], max_new_tokens: int = 256, temperature: float = 0.0,
               on_text: Any = None) -> str:
    """The answer to `messages` (the last one the user's), streamed to `on_text` as it is generated."""
    from orchestrate.chat import reply

    return reply(model, messages, max_new_tokens, temperature, on_text)


# --- export, profile, schema ---------------------------------------------------------------------


def export(run_dir: Path, out: Path, step: int | None = None, merge: bool = False, fmt: str = "hf",
           quant: str | None = None) -> Path:
    """A consolidated Hugging Face model from a run's checkpoint; returns the checkpoint used. `merge`: a
    LoRA / QLoRA run's adapters merged into its base. `fmt` "gguf": one GGUF file for llama.cpp and
    Ollama (and a Modelfile) instead, `quant` "f16" (the default) or "q8_0"."""
    from orchestrate.export import export_checkpoint

    return export_checkpoint(Path(run_dir), Path(out), step, merge=merge, fmt=fmt, quant=quant)


def profile(flags: HardwareFlags) -> HardwareProfile:
    """The hardware profile plans use: detected, a preset, or the flags."""
    return flags.resolve()


def profile_yaml(profile: HardwareProfile) -> str:
    from orchestrate.hardware.resolve import profile_to_yaml

    return profile_to_yaml(profile)


def write_profile(profile: HardwareProfile, out: Path) -> Path:
    """`profile --out FILE`: the profile as YAML, never over a file `profile --out` did not write."""
    from orchestrate.hardware.resolve import write_profile as write

    return write(profile, Path(out))


def profile_table(profile: HardwareProfile) -> Any:
    """A rich table of the profile."""
    from orchestrate.hardware.describe import profile_table as table

    return table(profile)


def hardware_presets() -> list[str]:
    from orchestrate.hardware.presets import list_presets

    return list_presets()


def describe_schema() -> str:
    from orchestrate.config.describe import describe_schema as describe

    return describe()
