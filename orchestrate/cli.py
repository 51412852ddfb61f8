"""The `orchestrate` command: parse flags, call `orchestrate.api`, print. Nothing else.

Every user-fixable problem surfaces as a `UserError`: printed as one message listing every
problem, exit code 2, no traceback.
"""

from __future__ import annotations

import functools
import json
import shlex
import sys
from pathlib import Path

import click
from rich.console import Console
from rich.markup import escape

from orchestrate import api
from orchestrate.api import HardwareFlags
from orchestrate.errors import EXIT_USER_ERROR, Problem, UserError
from orchestrate.run.exits import EX_TEMPFAIL
from orchestrate.run.layout import LOG_DIR, PLAN_FILE

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
        click.option("--gpus-per-node", type=int,
                     help="GPUs per node, always GPUs: from a machine without, plans for GPU nodes (see --profile)."),
        click.option("--nodes", type=int, help="Number of machines."),
        click.option("--nvme", help="Directory on an NVMe disk for offload."),
        click.option("--no-calibration", is_flag=True,
                     help="Ignore this machine's measured memory corrections (~/.cache/orchestrate/calibration.json)."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def ssh_options(fn):
    """How `launch --hosts` reaches the hosts; each host's own settings belong in the ssh config."""
    options = [
        click.option("--ssh-user", help="SSH user on every host (default: the ssh config's, else yours)."),
        click.option("--ssh-port", type=int, help="SSH port on every host (default: the ssh config's, else 22)."),
        click.option("--ssh-key", type=click.Path(dir_okay=False), help="Private key file."),
        click.option("--ssh-config", type=click.Path(dir_okay=False),
                     help="ssh_config file to read instead of ~/.ssh/config (Host aliases, User, Port, ...)."),
        click.option("--known-hosts", type=click.Path(dir_okay=False),
                     help="Extra known_hosts file of trusted host keys (besides ~/.ssh/known_hosts)."),
        click.option("--trust-new-hosts", is_flag=True,
                     help="Accept and record the key of a host not in known_hosts (a changed key is still refused)."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def _ssh_options(kwargs):
    values = {k: kwargs.pop(k) for k in ("ssh_user", "ssh_port", "ssh_key", "ssh_config", "known_hosts",
                                         "trust_new_hosts")}
    return api.ssh_options(user=values["ssh_user"], port=values["ssh_port"], key_filename=values["ssh_key"],
                           ssh_config=Path(values["ssh_config"]) if values["ssh_config"] else None,
                           known_hosts=Path(values["known_hosts"]) if values["known_hosts"] else None,
                           trust_on_first_use=values["trust_new_hosts"])


def _flags(kwargs) -> HardwareFlags:
    return HardwareFlags(**{k: kwargs.pop(k) for k in ("profile", "gpus", "gpu_mem", "cpu_mem", "nodes", "nvme",
                                                        "gpus_per_node")},
                         calibration=not kwargs.pop("no_calibration"))


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
    the_plan = api.plan_from_file(config, overrides, _flags(kwargs))
    if out:
        api.write_plan(the_plan, Path(out))
    if as_json:
        click.echo(json.dumps(api.render_plan(the_plan), indent=2))
    else:
        api.render_plan(the_plan, console)
    if simulate and api.is_runnable(the_plan):
        console.print("simulating the chosen plan (real model code on fake tensors)...")
        console.print(api.verify(the_plan), markup=False, highlight=False, soft_wrap=True)
    api.require_feasible(the_plan)


@cli.command("config")
@click.argument("config_path", metavar="CONFIG", type=click.Path(dir_okay=False))
@hardware_options
@set_option
@click.option("--out", required=True, type=click.Path(file_okay=False),
              help="Directory for plan.json and the rendered DeepSpeed/FSDP/Accelerate files.")
@click.option("--force", is_flag=True,
              help="Write into a non-empty directory that is not a run directory (nothing there is replaced).")
@click.option("--for", "for_tool", type=click.Choice(api.CONFIG_TARGETS),
              help="Also write files for this tool: hf-trainer = a DeepSpeed config with \"auto\" values a stock "
                   "HF Trainer takes, and the TrainingArguments values that train like the plan.")
@_user_errors_exit_2
def config_cmd(config_path, overrides, out, force, for_tool, **kwargs):
    """Plan and write plan.json plus the rendered backend configs, without launching (the checks of
    `launch` included: data, existing checkpoints)."""
    written = api.write_config(api.load_config(config_path, overrides), _flags(kwargs), Path(out),
                               name=Path(config_path).stem, force=force, for_tool=for_tool)
    console.print(f"chosen: [bold]{written.chosen.name}[/]")
    for role, name in written.files.model_dump().items():
        if (Path(out) / name).is_file():
            console.print(f"  {role:<20} {Path(out) / name}")
    console.print(f"  {'plan':<20} {Path(out) / PLAN_FILE}")


@cli.command()
@click.argument("config_path", metavar="CONFIG", type=click.Path(dir_okay=False))
@click.argument("program", nargs=-1, type=click.UNPROCESSED)
@hardware_options
@set_option
@click.option("--run-dir", type=click.Path(file_okay=False), help="Run directory (default: <train.output_dir>/<name>-<time>).")
@click.option("--dry-run", is_flag=True, help="Write the run directory and print the torchrun command; start nothing.")
@click.option("--max-restarts", type=click.IntRange(min=0), default=0, show_default=True, help="torchrun: restarts of the worker group on failure.")
@click.option("--master-addr", help="torchrun: static rendezvous address (multi-node).")
@click.option("--master-port", type=int, help="torchrun: rendezvous port (default: a free port).")
@click.option("--rdzv-backend", help="torchrun: rendezvous backend (default c10d).")
@click.option("--rdzv-endpoint", help="torchrun: HOST:PORT of the rendezvous (multi-node).")
@click.option("--rdzv-id", help="torchrun: rendezvous id shared by all nodes.")
@click.option("--node-rank", type=int, help="torchrun: this node's rank (static rendezvous).")
@click.option("--hosts", type=click.Path(dir_okay=False),
              help="Hostfile (`HOST slots=N` lines): one torchrun per host over SSH, rendezvous on the first.")
@ssh_options
@click.option("--python", "python", help="Absolute interpreter path on the nodes (default: this one).")
@click.option("--resume", is_flag=True,
              help="Continue the newest run of CONFIG (or --run-dir) from its latest checkpoint; its own plan "
                   "when config and world size are unchanged, else re-planned (resharded).")
@click.option("--force", is_flag=True,
              help="Write into a non-empty directory that is not a run directory (nothing there is replaced).")
@_user_errors_exit_2
def launch(config_path, program, overrides, run_dir, dry_run, max_restarts, master_addr, master_port, rdzv_backend,
           rdzv_endpoint, rdzv_id, node_rank, hosts, python, resume, force, **kwargs):
    """Plan, write the run directory and train with torchrun workers.

    Here, on the hosts of --hosts over SSH, or, inside a SLURM allocation, on its nodes with srun.
    `orchestrate launch CONFIG -- python train.py ARGS` runs your own training loop under the plan
    instead (docs/own-loop.md)."""
    config = api.load_config(config_path, overrides)
    name = Path(config_path).stem
    transport = api.choose_transport(
        hosts=Path(hosts) if hosts else None, ssh=_ssh_options(kwargs), python=python, name=name, program=program,
        options=api.launch_options(master_addr=master_addr, master_port=master_port, rdzv_backend=rdzv_backend,
                                   rdzv_endpoint=rdzv_endpoint, rdzv_id=rdzv_id, node_rank=node_rank))
    request = api.launch_request(config, _flags(kwargs), name=name, run_dir=Path(run_dir) if run_dir else None,
                                 dry_run=dry_run, max_restarts=max_restarts, resume=resume, force=force,
                                 program=tuple(program))
    result = api.launch(request, transport, console)
    if result.exit_code == EX_TEMPFAIL:
        err_console.print(f"[bold yellow]stopped early[/] (exit {EX_TEMPFAIL}: requeue); "
                          "continue with: " + escape(shlex.join(["orchestrate", "launch", config_path, "--resume",
                                                                  "--run-dir", str(result.run_dir)])),
                          soft_wrap=True)
    elif result.exit_code:
        err_console.print(f"[bold red]training failed[/] (exit {result.exit_code}); logs: {result.run_dir / LOG_DIR}")
    sys.exit(result.exit_code or 0)


@cli.command("export")
@click.argument("run_dir", type=click.Path(file_okay=False, exists=True))
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Directory for the exported model.")
@click.option("--step", type=int, help="Export the checkpoint of this step (default: the latest).")
@click.option("--merge", is_flag=True, help="LoRA / QLoRA run: merge the checkpoint's adapters into the base (fp32).")
@click.option("--format", "fmt", type=click.Choice(["hf", "gguf"]), default="hf", show_default=True,
              help="hf: a Hugging Face model directory; gguf: model.gguf + Modelfile for llama.cpp and Ollama.")
@click.option("--quant", type=click.Choice(["f16", "q8_0"]),
              help="--format gguf: the weights' type (default f16; q8_0 about half the size).")
@_user_errors_exit_2
def export_cmd(run_dir, out, step, merge, fmt, quant):
    """Write a consolidated Hugging Face model (safetensors + config.json + tokenizer) from a run's
    checkpoint, offline on the CPU, whatever backend and world size wrote it; or, with --format gguf,
    one GGUF file (tokenizer and chat template inside) and an Ollama Modelfile."""
    ckpt = api.export(Path(run_dir), Path(out), step, merge=merge, fmt=fmt, quant=quant)
    console.print(f"exported {ckpt} -> {out}", markup=False, highlight=False)


@cli.command("chat")
@click.argument("run_dir", type=click.Path(file_okay=False, exists=True))
@click.option("--prompt", help="Ask this once, print the answer and exit (for scripts); without it: a conversation.")
@click.option("--system", help="The system prompt before the conversation (default: the run's data.system_prompt; "
                                "'' for none).")
@click.option("--adapter/--model", "adapter", default=None,
              help="Base + RUN_DIR/adapter, or RUN_DIR/model (default: RUN_DIR/model when it exists).")
@click.option("--template/--raw", "template", default=None,
              help="Render the prompt with the saved chat template, or as raw text (default: as the run rendered "
                   "its records).")
@click.option("--max-new-tokens", type=click.IntRange(min=1, max=2**20), default=256, show_default=True)
@click.option("--temperature", type=click.FloatRange(min=0, max=100), default=0.0, show_default=True,
              help="0: greedy decoding.")
@_user_errors_exit_2
def chat_cmd(run_dir, prompt, system, adapter, template, max_new_tokens, temperature):
    """Talk to the model a run trained, with its saved tokenizer, prompting as training did (streamed)."""
    model = api.chat_model(Path(run_dir), adapter, template, system)
    history: list[dict[str, str]] = []

    def answer(text: str) -> str:
        history.append({"role": "user", "content": text})
        reply = api.chat_reply(model, history, max_new_tokens, temperature, lambda t: click.echo(t, nl=False))
        click.echo()
        history.append({"role": "assistant", "content": reply})
        return reply

    if prompt is not None:
        answer(prompt)
        return
    err_console.print(f"chatting with {model.source} (an empty line or Ctrl-D ends)", highlight=False)
    while True:
        try:
            line = click.prompt("you", default="", show_default=False, prompt_suffix="> ")
        except click.exceptions.Abort:  # Ctrl-D / Ctrl-C: the end of the conversation, not an error
            break
        except UnicodeDecodeError as exc:
            raise UserError("stdin is not valid UTF-8", [Problem(
                "stdin", f"byte {exc.start} of the line is no UTF-8 character", "type or pipe UTF-8 text")]) from None
        if not line.strip():
            break
        answer(line)


@cli.command("report")
@click.argument("run_dirs", metavar="RUN_DIR...", nargs=-1, required=True, type=click.Path(file_okay=False))
@click.option("--out", type=click.Path(file_okay=False), help="Directory for the PNGs and summary.md (default: RUN_DIR/report).")
@_user_errors_exit_2
def report_cmd(run_dirs, out):
    """Plots (loss, throughput/MFU, lr/grad norm, memory) and summary.md for one or more runs, overlaid."""
    report = api.report([Path(d) for d in run_dirs], Path(out) if out else None)
    for path in [*report.images, report.summary]:
        console.print(str(path), markup=False, highlight=False)


@cli.command("slurm")
@click.argument("config_path", metavar="CONFIG", type=click.Path(dir_okay=False))
@hardware_options
@set_option
@click.option("--partition", help="sbatch --partition.")
@click.option("--time", "time_limit", help="sbatch --time, e.g. 4:00:00 (default: the partition's).")
@click.option("--account", help="sbatch --account.")
@click.option("--mem", help="sbatch --mem per node, e.g. 64G (default: the partition's).")
@click.option("--cpus-per-task", type=int, help="CPUs per node for its torchrun and workers (default: one per rank).")
@click.option("--job-name", help="sbatch --job-name (default: the config file's name).")
@click.option("--signal-lead", type=int,
              help="Seconds before the time limit to checkpoint and requeue (0: never; default: "
                   "train.preemption_grace_s, the workers' time to checkpoint).")
@click.option("--no-requeue", is_flag=True, help="Do not requeue the job after a checkpoint signal.")
@click.option("--sbatch-option", "extra_sbatch", multiple=True, metavar="OPTION",
              help="One more sbatch option, its own #SBATCH line, e.g. --sbatch-option=--exclusive (repeatable).")
@click.option("--python", "python", help="Absolute interpreter path on the compute nodes (default: this one).")
@click.option("--max-restarts", type=click.IntRange(min=0), default=0, show_default=True, help="torchrun: restarts of the worker group.")
@click.option("--run-dir", type=click.Path(file_okay=False),
              help="Run directory, on a filesystem the nodes share (default: <train.output_dir>/<name>-<time>).")
@click.option("--test-only", is_flag=True, help="Ask Slurm whether and when it would run the job (sbatch --test-only).")
@click.option("--submit", is_flag=True, help="Submit the job (sbatch) and print its id.")
@click.option("--resume", is_flag=True,
              help="Continue the newest run of CONFIG (or --run-dir) from its latest checkpoint, in a new job.")
@_user_errors_exit_2
def slurm_cmd(config_path, overrides, partition, time_limit, account, mem, cpus_per_task, job_name, signal_lead,
              no_requeue, extra_sbatch, python, max_restarts, run_dir, test_only, submit, resume, **kwargs):
    """Plan for --nodes x --gpus-per-node, write the run directory and a SLURM batch script.

    The job checkpoints and requeues itself on USR1 (sent --signal-lead seconds before the time
    limit, or by `scancel -s USR1 -b JOB`) and resumes from the run directory."""
    options = api.slurm_options(partition=partition, time=time_limit, account=account, mem=mem,
                                cpus_per_task=cpus_per_task, job_name=job_name, signal_lead_s=signal_lead,
                                requeue=not no_requeue, python=python or sys.executable,
                                extra_sbatch=tuple(extra_sbatch))
    prepared = api.prepare_slurm(api.load_config(config_path, overrides), _flags(kwargs), name=Path(config_path).stem,
                                 run_dir=Path(run_dir) if run_dir else None, options=options,
                                 max_restarts=max_restarts, resume=resume, console=console)
    if test_only:
        console.print(f"sbatch --test-only: {api.slurm_test_only(prepared.script)}", markup=False, highlight=False)
    if not submit:
        console.print(f"submit with: {shlex.join(['sbatch', str(prepared.script)])}", markup=False, highlight=False,
                      soft_wrap=True)
        return
    job_id = api.slurm_submit(prepared.script)
    click.echo(f"submitted job {job_id}")
    console.print(f"  output:     {prepared.run_dir / f'slurm-{job_id}.out'}\n"
                  f"  checkpoint and requeue: scancel --signal=USR1 --batch {job_id}\n"
                  f"  cancel:     scancel {job_id}", markup=False, highlight=False)


@cli.command()
@hardware_options
@click.option("--out", type=click.Path(dir_okay=False), help="Write the profile as YAML to this file.")
@click.option("--yaml", "as_yaml", is_flag=True, help="Print the profile as YAML instead of a table.")
@click.option("--list", "list_presets", is_flag=True, help="List the built-in presets.")
@_user_errors_exit_2
def profile(out, as_yaml, list_presets, **kwargs):
    """Show the hardware profile orchestrate plans for (detected, preset or flags)."""
    if list_presets:
        for name in api.hardware_presets():
            click.echo(name)
        return
    found = api.profile(_flags(kwargs))
    if as_yaml:
        click.echo(api.profile_yaml(found), nl=False)
        return
    console.print(api.profile_table(found))
    if out:
        api.write_profile(found, Path(out))
        console.print(f"wrote {out} (use it with --profile {out})")


@cli.command()
@click.argument("config_path", metavar="CONFIG", type=click.Path(dir_okay=False))
@set_option
@click.option("--force", is_flag=True, help="Tokenise again even if the cache holds this data (replaces the entry).")
@_user_errors_exit_2
def prepare(config_path, overrides, force):
    """Tokenise the config's data into the shared cache (data.cache_dir), so launches start at once."""
    console.print(api.prepare(api.load_config(config_path, overrides), force=force), markup=False, highlight=False)


@cli.group()
def tokenizer():
    """Make a tokenizer for data that has none."""


@tokenizer.command("train")
@click.argument("config_path", metavar="CONFIG", type=click.Path(dir_okay=False))
@set_option
@click.option("--vocab-size", type=int, required=True, help="Ids in the vocabulary, end-of-text token included.")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="New directory for the tokenizer.")
@_user_errors_exit_2
def tokenizer_train(config_path, overrides, vocab_size, out):
    """Train a byte-level BPE tokenizer on the config's training data (Hugging Face format)."""
    out_dir, size = api.train_tokenizer(api.load_config(config_path, overrides), vocab_size, Path(out))
    console.print(f"wrote {out_dir} ({size:,} ids); use it with data.tokenizer: {out_dir} and a model "
                  f"vocab_size of at least {size}", markup=False, highlight=False)


@cli.command()
def schema():
    """List every model.yaml key with its type, default and meaning."""
    click.echo(api.describe_schema())


def main() -> None:
    cli(prog_name="orchestrate")


if __name__ == "__main__":
    main()
