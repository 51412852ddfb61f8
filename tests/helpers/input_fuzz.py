"""orchestrate's input surfaces, each as the inputs a new user or an attacker could give it (a hypothesis
strategy) and the invariant it must hold for every one of them (a check that raises on a break):
the YAML parser, `--set`, whole `orchestrate plan` calls, data records of every format (GRPO's prompt
files among them), chat templates, hostfiles, the rendezvous flags and the SLURM fields.

The property tests (tests/unit/config, data, cli, launch, transports) run each surface for a few
seeded examples; `bench/fuzz.py` runs them all for many more and tables what broke. The invariants:
the answer is a value or one UserError whose problems name where the input came from (never another
exception, never a traceback through the CLI), within a time bound per input; what a command line
receives from an accepted value is exactly one word that no program reads as an option."""

from __future__ import annotations

import json
import math
import shlex
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from hypothesis import strategies as st

from orchestrate.errors import UserError

ROOT = Path(__file__).resolve().parents[2]


class InvariantBroken(AssertionError):
    """An input the surface answered wrongly: `invariant` names the rule, the message what happened."""

    def __init__(self, invariant: str, detail: str = ""):
        super().__init__(f"{invariant}: {detail}" if detail else invariant)
        self.invariant = invariant


def require(condition: object, invariant: str, detail: object = "") -> None:
    if not condition:
        raise InvariantBroken(invariant, str(detail)[:2000])


def within(start: float, seconds: float) -> None:
    elapsed = time.perf_counter() - start
    require(elapsed < seconds, f"answers within {seconds:g} s", f"took {elapsed:.1f} s")


def user_error_names(exc: UserError, prefix: str) -> None:
    require(exc.problems and all(p.where.startswith(prefix) for p in exc.problems),
            f"a UserError's problems name {prefix}", [p.where for p in exc.problems])


@dataclass(frozen=True)
class Surface:
    """One input surface: `check(value)` for any `value` drawn from `strategy` returns, or raises
    InvariantBroken (the surface answered wrongly) or the exception the code let escape."""

    name: str
    strategy: st.SearchStrategy
    check: Callable[[Any], None]


# -- YAML and --set ---------------------------------------------------------------------------------

raw_yaml = st.lists(st.sampled_from([
    "a", "train", ".", "seq_len", ":", " ", "\n", "\t", "-", "[", "]", "{", "}", ",", "&x", "*x", "!!str",
    "!!python/name:os.system", "'", '"', "#", "|", ">", "?", "%YAML 1.1\n", "---", "...", "<<: *x", "1e3", "yes",
    "0x1F", "\x00", "\x01", "\x07", "\x1b[31m", "\x7f", "\x85", "\u2028", "\ufeff", "\ud800", "\udce9", "é", "🙂",
    "=", "\\", "\\x01", "[" * 80,
]), max_size=16).map("".join)
"""Raw text from YAML's syntax, control characters, lone surrogates (undecodable argv bytes), aliases."""

YAML_SECONDS = 2.0


def check_yaml_text(text: str) -> None:
    from orchestrate.config import safe_yaml

    start = time.perf_counter()
    try:
        safe_yaml.parse(text, "model.yaml")
    except UserError as exc:
        user_error_names(exc, "model.yaml")
    within(start, YAML_SECONDS)


def check_overrides(overrides: list[str]) -> None:
    from orchestrate.config.load import parse_overrides

    start = time.perf_counter()
    parsed, problems = parse_overrides(overrides)
    require(len(parsed) + len(problems) >= len(overrides), "every --set is a value or a problem")
    for problem in problems:
        try:
            problem.render().encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvariantBroken("a problem prints (no lone surrogate)", repr(problem.render())) from exc
    within(start, YAML_SECONDS)


# -- whole `orchestrate plan` calls: the demo config mutated ----------------------------------------

PLAN_KEYS = ["model.architecture.n_embd", "model.architecture.n_layer", "model.architecture.n_head",
             "model.architecture.n_positions", "model.architecture.vocab_size", "model.architecture.model_type",
             "model.trust_remote_code", "model.name_or_path", "model", "train", "train.seq_len",
             "train.global_batch_size", "train.micro_batch_size", "train.precision", "train.activation_checkpointing",
             "train.optimizer.lr", "train.optimizer.betas", "train.optimizer.eps", "train.optimizer.weight_decay",
             "train.schedule.warmup_steps", "train.schedule.min_lr_ratio", "train.max_steps", "train.seed",
             "train.grad_clip", "train.output_dir", "data.num_proc", "data.tokenizer", "data.train_files",
             "strategy.backend", "strategy.zero_stage", "strategy.offload", "strategy.offload_params",
             "strategy.nvme_path", "strategy.gpu_memory_headroom", "strategy.cpu_memory_headroom", "bogus.key"]
plan_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, 2, 3, 4, 7, 64, 256, 2**31 - 1, 2**31, 2**63, -1]),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20),
    st.sampled_from(["auto", "bf16", "fp16", "deepspeed", "fsdp", "ddp", "cpu", "nvme", "yes", "on", "1e-3", "é✓🙂"]),
)
plan_values = st.recursive(plan_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)), max_leaves=12)
plan_tails = st.sampled_from([
    "", "x: &a [1, 2]\ny: *a\n", "x: &a [*a]\n", "train:\n  seq_len: 8\n", "\t- broken: [\n",
    "x: !!python/object:os.system {}\n", "x: " + "[" * 200 + "]" * 200 + "\n", "x: {a: &b {c: 1}, d: *b, <<: *b}\n",
    "? [1, 2]\n: 3\n", "x: 0x1F\n",
    "# caf\udce9\n",  # a lone surrogate: written as the invalid UTF-8 byte 0xe9 (surrogateescape)
])
plan_cases = st.fixed_dictionaries({
    "mutations": st.lists(st.tuples(st.sampled_from(PLAN_KEYS), plan_values), max_size=4),
    "overrides": st.lists(st.tuples(st.sampled_from(PLAN_KEYS), plan_values), max_size=3),
    "tail": plan_tails})
"""The demo config with up to 4 keys set to any value, up to 3 `--set` overrides, and a raw YAML tail."""

PLAN_SECONDS = 10.0


def demo_config() -> dict:
    """examples/tiny-gpt2.yaml without its data section (planning needs none)."""
    base = yaml.safe_load((ROOT / "examples" / "tiny-gpt2.yaml").read_text())
    base.pop("data", None)
    return base


def _set(data: dict, dotted: str, value) -> None:
    parts = dotted.split(".")
    for part in parts[:-1]:
        if not isinstance(data.get(part), dict):
            data[part] = {}
        data = data[part]
    data[parts[-1]] = value


def yaml_scalar(value) -> str:
    """`value` as the YAML text of a `--set KEY=VALUE`."""
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return ".nan" if math.isnan(value) else ("-.inf" if value < 0 else ".inf")
    return yaml.safe_dump(value, default_flow_style=True, allow_unicode=True).strip().removesuffix("...").strip()


def invoke_cli(args: list[str]):
    """`orchestrate ARGS` in-process; InvariantBroken unless it exits 0 or 2 without a traceback."""
    from click.testing import CliRunner

    from orchestrate.cli import cli

    result = CliRunner().invoke(cli, args)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise InvariantBroken("exit 0 or 2, no traceback",
                              "".join(traceback.format_exception(result.exception))[-3000:]) from result.exception
    require(result.exit_code in (0, 2), "exit 0 or 2, no traceback", result.output[-2000:])
    require("Traceback" not in result.output, "exit 0 or 2, no traceback", result.output[-2000:])
    return result


def plan_surface(workdir: Path) -> Surface:
    """`orchestrate plan` of the mutated demo config (the first call, outside the bound, imports)."""
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "model.yaml"
    path.write_text(yaml.safe_dump(demo_config()))
    invoke_cli(["plan", str(path), "--profile", "rtx3070"])

    def check(case: dict) -> None:
        data = demo_config()
        for key, value in case["mutations"]:
            _set(data, key, value)
        text = yaml.safe_dump(data, allow_unicode=True) + case["tail"]
        path.write_bytes(text.encode("utf-8", errors="surrogateescape"))
        args = ["plan", str(path), "--profile", "rtx3070"]
        for key, value in case["overrides"]:
            args += ["--set", f"{key}={yaml_scalar(value)}"]
        start = time.perf_counter()
        invoke_cli(args)
        within(start, PLAN_SECONDS)

    return Surface("orchestrate plan (YAML + --set)", plan_cases, check)


# -- data records of every format -------------------------------------------------------------------

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = ["system", "user", "assistant", "hello", "there", "yes", "no"]
RECORD_SECONDS = 5.0

texts = st.lists(st.sampled_from(["hello", " ", "there", "yes", "\n", "\t", "{{", "%}", "<|im_end|>", "\x00", "é",
                                  "🙂", "\ud800"]), max_size=12).map("".join)
scalars = st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.floats(allow_nan=True), texts)
roles = st.sampled_from(["user", "assistant", "system", "tool", "human", "gpt", "bogus", None, 3])
message = st.fixed_dictionaries({}, optional={
    "role": roles, "content": st.one_of(texts, scalars, st.lists(texts, max_size=2)), "from": roles, "value": texts,
    "tool_calls": st.one_of(texts, st.lists(st.dictionaries(texts, scalars, max_size=2), max_size=2), scalars),
    "name": scalars, "tool_call_id": scalars})
anything = st.one_of(scalars, st.lists(message, max_size=6), st.lists(scalars, max_size=3),
                     st.dictionaries(texts, scalars, max_size=3))
RECORD_FORMATS = {
    "chat": ["messages"], "chat-sharegpt": ["conversations"], "prompt-completion": ["prompt", "completion"],
    "alpaca": ["instruction", "input", "output"], "preference": ["prompt", "chosen", "rejected"],
    "unpaired-preference": ["prompt", "completion", "label"],
}
"""Each record format (data/records.py) and its columns."""


def _tiny_config(workdir: Path, extra: dict, data: dict):
    from orchestrate.config.load import config_from_dict
    from orchestrate.data.chat_templates import CHATML
    from tests.helpers.chat_tokenizers import word_chat_tokenizer
    from tests.helpers.plans import TINY_GPT2

    if not (workdir / "tok").is_dir():
        word_chat_tokenizer(workdir / "tok", WORDS, SPECIALS, eos="<|im_end|>", template=CHATML.source)
    return config_from_dict({
        "model": {"architecture": {**TINY_GPT2, "vocab_size": 64, "n_positions": 128}},
        "train": {"seq_len": 32, "global_batch_size": 2},
        "data": {"tokenizer": "tok", "train_files": ["x.jsonl"], **data}, **extra}, workdir)


def record_surface(workdir: Path, name: str) -> Surface:
    """One record of format `name` with any values in its columns, tokenised as `prepare` does."""
    from orchestrate.data.pipeline import tokenizer_for
    from orchestrate.data.sft_prepare import SftSettings, tokenize_records
    from orchestrate.methods.registry import method_data

    record_format = "chat" if name.startswith("chat") else name
    workdir.mkdir(parents=True, exist_ok=True)
    preference = {"preference": {"loss": "kto"} if record_format == "unpaired-preference" else {"beta": 0.1}}
    config = _tiny_config(workdir, preference if "preference" in record_format else {},
                          {"roles_to_train": ["user", "assistant"]})
    tokenizer, _ = tokenizer_for(config)
    sft = SftSettings.of(config, method_data(config))
    template = sft.template_for("chat", tokenizer)

    def check(record: dict) -> None:
        start = time.perf_counter()
        try:
            out = tokenize_records({k: [v] for k, v in record.items()}, [0], tokenizer=tokenizer, settings=sft,
                                   record_format=record_format, template=template, dtype="int32")
        except UserError:
            return
        within(start, RECORD_SECONDS)
        require(len(out["input_ids"]) == 1 and isinstance(out["problem"][0], str), "tokens or a problem per record")

    return Surface(f"records: {name}", st.fixed_dictionaries({c: anything for c in RECORD_FORMATS[name]}), check)


_json_values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                             st.dictionaries(texts, inner, max_size=3)),
                            max_leaves=8)
_prompt_records = st.fixed_dictionaries({}, optional={"prompt": anything, "answer": anything, "other": scalars})
prompt_lines = st.lists(st.one_of(
    _prompt_records.map(lambda r: json.dumps(r).encode()),
    _json_values.map(lambda v: json.dumps(v).encode()),
    st.sampled_from([b"", b"   ", b"{", b"\xff\xfe", b"caf\xe9", b"\x00", b"[1, 2]", b"null", b'"prompt"',
                     b'{"prompt": "hello", "answer": "yes"}', b'{"prompt": [], "answer": "x"}']),
), max_size=5)
"""The lines of a GRPO prompt file: records with any prompt and answer, any JSON value, broken bytes."""


def grpo_prompt_surface(workdir: Path) -> Surface:
    """A GRPO prompt file read as `prepare` and the launcher read it, each prompt rendered as the
    rollout renders it: records or one UserError naming the file's key, then ids or one UserError."""
    from orchestrate.data.chat_template import ChatTemplate
    from orchestrate.data.chat_templates import CHATML
    from orchestrate.data.tokenizer import load_tokenizer
    from orchestrate.methods.grpo.prompts import load_prompts, render_prompt

    workdir.mkdir(parents=True, exist_ok=True)
    config = _tiny_config(workdir, {"grpo": {"num_generations": 2, "max_completion_length": 8,
                                             "rewards": [{"kind": "exact_match", "column": "answer"}]}},
                          {"train_files": ["prompts.jsonl"], "validation_files": ["prompts.jsonl"]})
    tokenizer = load_tokenizer(workdir / "tok")
    template = ChatTemplate(CHATML.source, "chatml")

    def check(lines: list[bytes]) -> None:
        (workdir / "prompts.jsonl").write_bytes(b"\n".join(lines))
        start = time.perf_counter()
        try:
            train, _ = load_prompts(config)
        except UserError as exc:
            user_error_names(exc, "data.")
            return
        for record in train:
            try:
                render_prompt(record["prompt"], config, tokenizer, template)
            except UserError as exc:
                user_error_names(exc, "data.")
        within(start, RECORD_SECONDS)

    return Surface("records: grpo prompts", prompt_lines, check)


# -- chat templates ---------------------------------------------------------------------------------

template_sources = st.lists(st.sampled_from([
    "{% for m in messages %}", "{% endfor %}", "{{ m.content }}", "{{ m.role }}", "{% if add_generation_prompt %}",
    "{% endif %}", "{{ 'x' * 10 }}", "{{ 'x' * 9999999999 }}", "{% for i in range(100000) %}",
    "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "{% include 'a' %}", "{{ messages[0] }}", "{{ 1 / 0 }}",
    "{{ 1 + 'a' }}", "{{ ''.__class__ }}", "{{ raise_exception('no') }}", "{% set ns = namespace(a=1) %}",
    "{{ messages | tojson }}", "{% generation %}", "{% endgeneration %}", "{{", "}}", "{%", "%}", "x", "\n",
    "{{ bos_token }}", "{{ 'a'.ljust(99999999999) }}", "{{ range(3) | list }}", "{{ messages * 99999999 }}",
]), max_size=8).map("".join)
TEMPLATE_RENDER_SECONDS = 0.5
"""The sandbox's render limit while fuzzing (chat_template.RENDER_SECONDS, lowered so a hang costs little)."""


def check_template(source: str) -> None:
    """Text, or a template error that `limit_error` words as one UserError naming the template."""
    import jinja2

    from orchestrate.data import chat_template
    from orchestrate.data.chat_template import ChatTemplate, render

    class Tok:
        special_tokens_map = {"bos_token": "<s>", "eos_token": "</s>"}

    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "yes"}]
    previous, chat_template.RENDER_SECONDS = chat_template.RENDER_SECONDS, TEMPLATE_RENDER_SECONDS
    start = time.perf_counter()
    try:
        render(ChatTemplate(source, "fuzz.jinja"), Tok(), messages, True)
    except jinja2.TemplateError as exc:
        error = chat_template.limit_error(ChatTemplate(source, "fuzz.jinja"), exc)
        require("fuzz.jinja" in error.problems[0].message, "a template error names the template",
                error.problems[0].message)
    finally:
        chat_template.RENDER_SECONDS = previous
    within(start, 3.0)


# -- hostfiles, ssh and the rendezvous flags --------------------------------------------------------

SSH_PYTHON = "/venv/bin/python"
host_names = st.one_of(
    st.from_regex(r"\A[a-z0-9][a-z0-9_.-]{0,12}\Z"),
    st.sampled_from(["::1", "[fd00::1]", "10.0.0.1", "-oProxyCommand=touch${IFS}/x", "a;b", "a@b", "a:22"]),
    st.text(st.one_of(st.sampled_from(list("az09-_.:[]%@;$`'\"# \n\t/\\=")), st.characters()), max_size=16))
hostfile_lines = st.lists(st.tuples(host_names, st.integers(0, 4) | st.integers(1, 4)), min_size=1, max_size=3)
"""(host, slots) lines of a hostfile."""


def ssh_argv(host: str, options=None) -> list[str]:
    """The argv of the ssh command line that runs a command on `host` (as launch.sh holds it)."""
    from orchestrate.transports.ssh.hosts import NodeCommand, SshOptions, ssh_command_line

    options = options if options is not None else SshOptions(
        user="alice", port=2222, key_filename="/k/id", ssh_config=Path("/c/ssh config"),
        known_hosts=Path("/c/known_hosts"))
    return shlex.split(ssh_command_line(NodeCommand(host, 0, (SSH_PYTHON, "-c", "pass"), (("K", "v w"),)), options))


def ssh_destination(argv: list[str]) -> tuple[str, list[str]]:
    """The host and what follows it, as OpenSSH reads argv: options end at the first `--`."""
    end = argv.index("--")
    return argv[end + 1], argv[end + 2:]


def check_hostfile(lines: list[tuple[str, int]]) -> None:
    """A UserError naming the hostfile's lines, or hosts each of which is exactly one argv element
    after `--` in the ssh command line (the host as written, IPv6 without brackets), never an option."""
    from orchestrate.launch.addresses import plain_host
    from orchestrate.transports.ssh.hosts import parse_hostfile

    text = "".join(f"{name} slots={slots}\n" for name, slots in lines)
    try:
        hosts = parse_hostfile(text, "hosts.txt")
    except UserError as exc:
        user_error_names(exc, "hosts.txt")
        return
    for host in hosts:
        destination, rest = ssh_destination(ssh_argv(host.name))
        require(destination == host.name and not destination.startswith("-") and len(rest) == 1,
                "a host is one ssh destination after --, never an option", (host.name, destination, rest))
    if all(name.isprintable() and not any(c.isspace() or c == "#" for c in name) for name, _ in lines):
        require([h.name for h in hosts] == [plain_host(name) for name, _ in lines], "hosts kept as written",
                (lines, hosts))


ports = st.one_of(st.none(), st.integers(-2, 70000), st.sampled_from([0, 1, 22, 29500, 65535, 65536, 99999]))
rendezvous_flags = st.fixed_dictionaries({
    "master_port": ports, "master_addr": st.one_of(st.none(), host_names),
    "rdzv_endpoint": st.one_of(st.none(), host_names, st.tuples(host_names, ports).map(lambda t: f"{t[0]}:{t[1]}"))})
"""`launch --master-port / --master-addr / --rdzv-endpoint` as typed."""

_SPLITTING = set(" \t\n;$`'\"\\/|&<>(){}*?#!~")


def check_rendezvous_flags(flags: dict) -> None:
    """One UserError naming each bad flag, or values that reach torchrun as one plain word each."""
    from orchestrate.launch.torchrun_args import LaunchOptions

    try:
        options = LaunchOptions(**{k: v for k, v in flags.items() if v is not None})
    except UserError as exc:
        user_error_names(exc, "--")
        return
    if options.master_port is not None:
        require(1 <= options.master_port <= 65535, "a port is 1 to 65535", options.master_port)
    for value in (options.master_addr, options.rdzv_endpoint):
        if value is not None:
            require(value.isascii() and value.isprintable() and not value.startswith("-")
                    and not set(value) & _SPLITTING, "an address is one plain word, no option", repr(value))


# -- SLURM fields -----------------------------------------------------------------------------------

_C_SPACE = " \t\n\v\f\r"
SLURM_PYTHON = "/opt/venv/bin/python"


def sbatch_words(line: str) -> list[str]:
    """The words sbatch reads from one `#SBATCH ...` line (a port of src/sbatch/opt.c's
    `_get_argument`): split at unquoted whitespace, '...' and "..." group, a backslash escapes the
    next character but whitespace (inside quotes too), an unquoted # ends the line."""
    words, i, rest = [], 0, line[len("#SBATCH"):]
    while True:
        while i < len(rest) and rest[i] in _C_SPACE:
            i += 1
        word, quote, escaped = None, "", False
        while i < len(rest) and (quote or rest[i] not in _C_SPACE):
            c = rest[i]
            i += 1
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
                continue
            elif quote:
                if c == quote:
                    quote = ""
                    continue
            elif c in "\"'":
                quote, word = c, word or ""
                continue
            elif c == "#":
                return words + ([word] if word is not None else [])
            word = (word or "") + c
        require(not quote, "sbatch reads every line", f"unmatched {quote} in {line!r}")
        if word is None:
            return words
        words.append(word)


def header_words(script: str) -> list[list[str]]:
    """Each #SBATCH line's words, up to the first line sbatch takes for a command."""
    lines = []
    for line in script.split("\n")[1:]:
        if line.startswith("#SBATCH"):
            lines.append(sbatch_words(line))
        elif line.strip() and not line.lstrip().startswith("#"):
            return lines
    return lines


def slurm_job(**kw):
    from orchestrate.transports.slurm.job import SlurmJob

    return SlurmJob(**{"run_dir": Path("/runs/x"), "nodes": 2, "procs_per_node": 1, "python": SLURM_PYTHON, **kw})


slurm_text = st.one_of(
    st.from_regex(r"\A[a-z0-9][a-z0-9_.,-]{0,10}\Z"),
    st.text(st.one_of(st.sampled_from(list("az09-_.,+ \"'#%\\\n\t$;=")), st.characters()), max_size=14))
SLURM_VALID = {"partition": "gpu", "account": "proj42", "job_name": "run", "time": "4:00:00", "mem": "64G",
               "directory": "x", "extra": "note"}
slurm_fields = st.tuples(st.sampled_from(sorted(SLURM_VALID)), slurm_text)
"""(field, value): one SLURM field set to any text, the others valid."""


def _expected_words(v: dict[str, str]) -> list[str]:
    run_dir = Path("/runs") / v["directory"]
    return [f"--job-name={v['job_name']}", f"--partition={v['partition']}", f"--account={v['account']}",
            f"--time={v['time']}", f"--mem={v['mem']}", f"--chdir={run_dir}",
            f"--output={str(run_dir).replace('%', '%%')}/slurm-%j.out", f"--comment={v['extra']}"]


def check_slurm_field(field_value: tuple[str, str]) -> None:
    """One UserError, or a script whose #SBATCH lines sbatch splits into exactly one word each, the
    intended ones among them (the partition one option value, the paths whole)."""
    from orchestrate.transports.slurm.job import render_sbatch

    field, value = field_value
    v = {**SLURM_VALID, field: value}
    job = slurm_job(partition=v["partition"], account=v["account"], job_name=v["job_name"], time=v["time"],
                    mem=v["mem"], run_dir=Path("/runs") / v["directory"], extra_sbatch=("--comment=" + v["extra"],))
    try:
        script = render_sbatch(job)
    except UserError as exc:
        require(exc.problems, "a UserError lists its problems")
        return
    words = header_words(script)
    require(all(len(w) == 1 for w in words), "each #SBATCH line is one word", words)
    flat = [w[0] for w in words]
    require(set(_expected_words(v)) <= set(flat), "each value is the word it was meant to be", flat)
    require(len(flat) == script.count("\n#SBATCH "), "each #SBATCH line is one word", flat)


# -- all of them ------------------------------------------------------------------------------------

def all_surfaces(workdir: Path) -> list[tuple[str, Callable[[], Surface]]]:
    """Every input surface by name, each built when called (those that need files set them up under
    `workdir`)."""
    def plain(name: str, strategy: st.SearchStrategy, check: Callable[[Any], None]):
        return name, lambda: Surface(name, strategy, check)

    return [plain("YAML text", raw_yaml, check_yaml_text),
            plain("--set overrides", st.lists(raw_yaml, max_size=3), check_overrides),
            ("orchestrate plan (YAML + --set)", lambda: plan_surface(workdir / "plan")),
            *((f"records: {name}", lambda name=name: record_surface(workdir / "records", name))
              for name in RECORD_FORMATS),
            ("records: grpo prompts", lambda: grpo_prompt_surface(workdir / "grpo")),
            plain("chat templates", template_sources, check_template),
            plain("hostfiles (ssh)", hostfile_lines, check_hostfile),
            plain("rendezvous flags", rendezvous_flags, check_rendezvous_flags),
            plain("SLURM fields", slurm_fields, check_slurm_field)]
