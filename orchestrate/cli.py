"""The `orchestrate` command: parse flags, call `orchestrate.api` and friends, print. Nothing else.

Every user-fixable problem surfaces as a `UserError`: printed as one message listing every
problem, exit code 2, no traceback.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import click
from rich.console import Console

from orchestrate.api import HardwareFlags, plan_from_file
from orchestrate.errors import EXIT_USER_ERROR, UserError

# Candidate names are long; never wrap them on narrow terminals or pipes.
console = Console(width=max(160, Console().width))
err_console = Console(stderr=True)


def _user_errors_exit_2(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except UserError as exc:
            err_console.print(f"[bold red]error:[/] {exc}", markup=True, highlight=False, soft_wrap=True)
            sys.exit(EXIT_USER_ERROR)

    return wrapper


def hardware_options(fn):
    """The hardware flags shared by plan, config, launch and profile."""
    options = [
        click.option("--profile", "profile", help="Hardware preset name (see `orchestrate profile --list`) or a profile YAML file."),
        click.option("--gpus", type=int, help="GPUs per node (CPU-only machine: worker processes)."),
        click.option("--gpu-mem", help="Memory per GPU, e.g. 8GiB (plans for a GPU you don't have here)."),
        click.option("--cpu-mem", help="CPU RAM per node, e.g. 64GiB."),
        click.option("--nodes", type=int, help="Number of machines."),
        click.option("--nvme", help="Directory on an NVMe disk for offload."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def _flags(kwargs) -> HardwareFlags:
    return HardwareFlags(**{k: kwargs.pop(k) for k in ("profile", "gpus", "gpu_mem", "cpu_mem", "nodes", "nvme")})


set_option = click.option("--set", "overrides", multiple=True, metavar="PATH=VALUE",
                          help="Override a config field, e.g. --set train.seq_len=512 (repeatable).")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="orchestrate")
def cli():
    """Plan, configure and launch training of models that do not fit on your GPUs."""


@cli.command()
@click.argument("config", type=click.Path(dir_okay=False))
@hardware_options
@set_option
@click.option("--json", "as_json", is_flag=True, help="Print the plan as one JSON object (docs/plan-json.md).")
@click.option("--out", type=click.Path(file_okay=False), help="Also write DIR/plan.json.")
@click.option("--simulate", is_flag=True, help="Verify the chosen plan by running the real model code on fake tensors.")
@_user_errors_exit_2
def plan(config, overrides, as_json, out, simulate, **kwargs):
    """Predict memory and speed of every strategy and choose the fastest that fits."""
    from orchestrate.planner.report import plan_json, print_plan
    from orchestrate.planner.search import require_feasible

    the_plan = plan_from_file(config, overrides, _flags(kwargs))
    if out:
        the_plan.write(Path(out) / "plan.json")
    if as_json:
        click.echo(json.dumps(plan_json(the_plan), indent=2))
    else:
        print_plan(the_plan, console)
    if simulate and the_plan.chosen is not None:
        from orchestrate.simulate import verify_plan

        console.print(verify_plan(the_plan))
    require_feasible(the_plan)


@cli.command("config")
@click.argument("config_path", metavar="CONFIG", type=click.Path(dir_okay=False))
@hardware_options
@set_option
@click.option("--out", required=True, type=click.Path(file_okay=False),
              help="Directory for plan.json and the rendered DeepSpeed/FSDP/Accelerate files.")
@_user_errors_exit_2
def config_cmd(config_path, overrides, out, **kwargs):
    """Plan and write plan.json plus the rendered backend configs, without launching."""
    from orchestrate.config.load import load_config
    from orchestrate.launch.launcher import build_plan
    from orchestrate.launch.rundir import prepare_run

    config = load_config(config_path, overrides)
    written = prepare_run(build_plan(config, _flags(kwargs).resolve()), Path(out))
    console.print(f"chosen: [bold]{written.chosen.name}[/]")
    for role, name in written.files.items():
        if (Path(out) / name).is_file():
            console.print(f"  {role:<20} {Path(out) / name}")
    console.print(f"  {'plan':<20} {Path(out) / 'plan.json'}")


@cli.command()
@click.argument("config_path", metavar="CONFIG", type=click.Path(dir_okay=False))
@hardware_options
@set_option
@click.option("--run-dir", type=click.Path(file_okay=False), help="Run directory (default: <train.output_dir>/<name>-<time>).")
@click.option("--dry-run", is_flag=True, help="Write the run directory and print the torchrun command; start nothing.")
@click.option("--max-restarts", type=int, default=0, show_default=True, help="torchrun: restarts of the worker group on failure.")
@click.option("--master-addr", help="torchrun: static rendezvous address (multi-node).")
@click.option("--master-port", type=int, help="torchrun: rendezvous port (default: a free port).")
@click.option("--rdzv-backend", help="torchrun: rendezvous backend (default c10d).")
@click.option("--rdzv-endpoint", help="torchrun: HOST:PORT of the rendezvous (multi-node).")
@click.option("--rdzv-id", help="torchrun: rendezvous id shared by all nodes.")
@click.option("--node-rank", type=int, help="torchrun: this node's rank (static rendezvous).")
@_user_errors_exit_2
def launch(config_path, overrides, run_dir, dry_run, max_restarts, master_addr, master_port, rdzv_backend,
           rdzv_endpoint, rdzv_id, node_rank, **kwargs):
    """Plan, write the run directory and train with torchrun workers."""
    from orchestrate.config.load import load_config
    from orchestrate.launch.launcher import launch_from_config

    config = load_config(config_path, overrides)
    result = launch_from_config(
        config, _flags(kwargs).resolve(), name=Path(config_path).stem,
        run_dir=Path(run_dir) if run_dir else None, dry_run=dry_run, max_restarts=max_restarts,
        master_addr=master_addr, master_port=master_port, rdzv_backend=rdzv_backend,
        rdzv_endpoint=rdzv_endpoint, rdzv_id=rdzv_id, node_rank=node_rank, console=console)
    if result.exit_code:
        err_console.print(f"[bold red]training failed[/] (exit {result.exit_code}); logs: {result.run_dir / 'logs'}")
    sys.exit(result.exit_code or 0)


@cli.command()
@hardware_options
@click.option("--out", type=click.Path(dir_okay=False), help="Write the profile as YAML to this file.")
@click.option("--yaml", "as_yaml", is_flag=True, help="Print the profile as YAML instead of a table.")
@click.option("--list", "list_presets", is_flag=True, help="List the built-in presets.")
@_user_errors_exit_2
def profile(out, as_yaml, list_presets, **kwargs):
    """Show the hardware profile orchestrate plans for (detected, preset or flags)."""
    from orchestrate.hardware.presets import list_presets as presets
    from orchestrate.hardware.resolve import profile_to_yaml

    if list_presets:
        for name in presets():
            click.echo(name)
        return
    from orchestrate.hardware.describe import profile_table

    found = _flags(kwargs).resolve()
    if as_yaml:
        click.echo(profile_to_yaml(found), nl=False)
        return
    console.print(profile_table(found))
    if out:
        Path(out).write_text(profile_to_yaml(found))
        console.print(f"wrote {out} (use it with --profile {out})")


@cli.command()
def schema():
    """List every model.yaml key with its type, default and meaning."""
    from orchestrate.config.describe import describe_schema

    click.echo(describe_schema())


def main() -> None:
    cli(prog_name="orchestrate")


if __name__ == "__main__":
    main()
