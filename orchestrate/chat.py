"""`orchestrate chat RUN_DIR [--prompt TEXT]`: talk to what a run trained, in this process on the CPU
(or the first GPU), streaming the reply.

It loads RUN_DIR/model (the trained or merged model), or with `--adapter` (and by default when a LoRA
/ QLoRA run has no RUN_DIR/model) the frozen base as training held it (RUN_DIR/init_model or
model.name_or_path: NF4 for QLoRA, `model/adapter_loading.py`) plus RUN_DIR/adapter through
`PeftModel.from_pretrained`. The tokenizer and chat template are the ones saved next to it.

A prompt is rendered the way training rendered the run's records (data/records.py
`uses_chat_template`, the data pipeline's own rule, read from RUN_DIR/plan.json and, for
`data.record_format: auto`, the first training record: data/run_records.py; a method's own records
render as its `Method.record_format` says: GRPO's prompts as prompt-completion prompts): chat records (and
records of messages) and, with `data.chat_template` set, prompt-completion and Alpaca records went
through the chat template, so the conversation is rendered by the saved template with
`add_generation_prompt=True` and the reply ends at EOS or at the template's end-of-turn token (the
token trained after every answer). Prompt-completion and Alpaca records without `data.chat_template`,
and plain text, were raw text: the last message alone becomes the prompt as training built prompts
(Alpaca's prompt around it; the tokenizer's BOS, nothing after: data/sft_tokens.py
`completion_prompt_ids`) and the reply ends at EOS. `template` (`--template / --raw`) forces either.

The run's `data.system_prompt` went into every training record that brought no system turn of its own
(data/records.py `with_system`; a source's `system_prompt` in `data.datasets` applied to that source's
records only, so no conversation here is one of them): it goes in front of the conversation in the
same place, the template's system turn or the raw prompt's (Alpaca's preamble replaced). `system`
(`--system TEXT`) puts another there, `--system ''` none.

The template renders in the bounded sandbox of orchestrate/data/chat_template.py (a template that
loops or recurses without end is one error, not a hang); text that is no valid Unicode and a
conversation longer than the model's positions are refused with one message, and the reply is held
to the positions left after the prompt (past them GPT-2 raises and RoPE models emit garbage).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2

from orchestrate.data.chat_template import ChatTemplate, limit_error, render
from orchestrate.data.records import raw_prompt, uses_chat_template, with_system
from orchestrate.data.run_records import run_record_format
from orchestrate.data.sft_tokens import completion_prompt_ids
from orchestrate.errors import Problem, UserError
from orchestrate.methods.registry import active_methods
from orchestrate.planner.plan import RunPlan
from orchestrate.run.layout import RunDir


@dataclass
class ChatModel:
    model: Any
    tokenizer: Any
    stops: list[int]
    source: Path
    """The directory the weights (or the adapter) came from."""
    template: bool = True
    """Render the conversation with the saved chat template; False: the last message as raw text."""
    record_format: str = "chat"
    """The run's record format: how a raw prompt is put (`raw_prompt`)."""
    system: str | None = None
    """The system prompt put in front of a conversation that brings none: the run's
    `data.system_prompt` (as training gave it to every record without one), or `--system`'s; None: none."""


def _plan(run: RunDir):
    if not run.plan.is_file():
        raise UserError(f"{run.path} is not a run directory", [Problem(
            "RUN_DIR", f"{run.plan} does not exist", "give the directory `orchestrate launch` trained into")])
    return RunPlan.read(run.plan, read_only=True)


def _saved_template(tok) -> ChatTemplate:
    return ChatTemplate(tok.chat_template, "the run's saved chat template (tokenizer_config.json / chat_template.jinja)")


def check_text(text: str, where: str) -> str:
    """`text` when it is valid Unicode; a UserError when it holds bytes that were no UTF-8 (Python
    keeps those from argv as lone surrogates, which no tokenizer can encode)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise UserError("the text is not valid UTF-8", [Problem(
            where, f"byte {exc.start} of it is no UTF-8 character", "give the text in UTF-8")]) from None
    return text


def _positions(model) -> int | None:
    config = model.config
    return next((getattr(config, k) for k in ("max_position_embeddings", "n_positions", "n_ctx")
                 if isinstance(getattr(config, k, None), int)), None)


def _encode(chat: ChatModel, messages: list[dict[str, str]]) -> list[int]:
    """The conversation's prompt ids: rendered with the generation prompt by the saved template (in
    the bounded sandbox), or the last message as the raw prompt training built; the system prompt
    (`--system`, else the run's) where training put one."""
    tok = chat.tokenizer
    messages = with_system(messages, chat.system)
    if not chat.template:
        system = messages[0]["content"] if messages[0]["role"] == "system" else None
        return completion_prompt_ids(tok, raw_prompt(chat.record_format, messages[-1]["content"], system))
    template = _saved_template(tok)
    try:
        text = render(template, tok, messages, True)[0]
    except jinja2.TemplateError as exc:
        raise limit_error(template, exc, "RUN_DIR") from None
    return tok(text, add_special_tokens=False)["input_ids"]


def _end_of_turn(tok) -> list[int]:
    """The token the template ends an assistant turn with, when it is a special token of the tokenizer."""
    from orchestrate.data.sft_tokens import encode_chat

    probe = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    template = _saved_template(tok)
    try:
        encoded = encode_chat(tok, template, probe, ["assistant"], False)
    except jinja2.TemplateError as exc:
        raise limit_error(template, exc, "RUN_DIR") from None
    trained = [i for i, m in zip(encoded.ids, encoded.mask, strict=True) if m]
    return [trained[-1]] if trained and trained[-1] in tok.all_special_ids else []


def rendering(plan: RunPlan, run_dir: Path, template: bool | None) -> tuple[bool, str]:
    """(render with the chat template, the run's record format): as the run rendered its records, or
    as `template` forces. Forced raw, a run whose data is gone prompts with the text as it is."""
    if template:
        return True, "chat"
    own = next((m.record_format for m in active_methods(plan.config) if m.record_format), None)
    try:
        record_format, messages = run_record_format(plan.config, plan.files, run_dir, own)
    except UserError:
        if template is None:
            raise
        return False, "text"
    used = uses_chat_template(record_format, plan.config.data.chat_template is not None, messages)
    return used if template is None else template, record_format


def chosen_system(plan: RunPlan, system: str | None) -> str | None:
    """The system prompt to chat with: the run's data.system_prompt where `system` is None, none where it
    is empty (`--system ''`), else `system` (checked to be valid Unicode)."""
    if system is None:
        return plan.config.data.system_prompt
    return check_text(system, "--system") or None


def load_chat_model(run_dir: Path, adapter: bool | None = None, template: bool | None = None,
                    system: str | None = None) -> ChatModel:
    """The run's model (or base + adapter, see the module doc) with its saved tokenizer, in eval mode;
    `template`: render with the saved chat template (True) or raw (False), None: as the run did;
    `system`: the system prompt, None the run's, '' none (`chosen_system`)."""
    import torch
    from transformers import AutoModelForCausalLM

    from orchestrate.data.tokenizer import auto_tokenizer

    run = RunDir(Path(run_dir))
    plan = _plan(run)
    system = chosen_system(plan, system)  # before the model loads: a bad --system fails at once
    trust = plan.config.model.trust_remote_code
    use_adapter = adapter if adapter is not None else not run.model.is_dir() and run.adapter.is_dir()
    source = run.adapter if use_adapter else run.model
    if not (source / ("adapter_config.json" if use_adapter else "config.json")).is_file():
        what = "adapter (a LoRA / QLoRA run's RUN_DIR/adapter)" if use_adapter else "model (RUN_DIR/model)"
        raise UserError(f"the run has no trained {what}", [Problem(
            "RUN_DIR", f"{source} is missing or incomplete", "let the run finish (or `orchestrate export` a "
            "checkpoint and chat with that run), or choose the other one (--adapter / --model)")])
    templated, record_format = rendering(plan, run.path, template)
    tok = auto_tokenizer(source, trust)
    if templated and not tok.chat_template:
        raise UserError("the run's tokenizer has no chat template", [Problem(
            "--template" if template else "RUN_DIR", f"{source} holds no chat_template to render the conversation "
            "with", "chat with --raw (the prompt as text)")])
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    if use_adapter:
        from peft import PeftModel

        from orchestrate.loading.init_weights import existing_weights_dir
        from orchestrate.methods.lora.loading import load_adapter_base

        base, _ = load_adapter_base(existing_weights_dir(plan, run.path), plan, trust, plan.config.model.task)
        model = PeftModel.from_pretrained(base, str(source))
    else:
        model = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32, trust_remote_code=trust)
    model.to(device).eval()
    stops = sorted({*([tok.eos_token_id] if tok.eos_token_id is not None else []),
                    *(_end_of_turn(tok) if templated else [])})
    return ChatModel(model, tok, stops, source, templated, record_format, system)


def reply(chat: ChatModel, messages: list[dict[str, str]], max_new_tokens: int = 256, temperature: float = 0.0,
          on_text: Callable[[str], None] | None = None) -> str:
    """The model's answer to the conversation (its last message the user's), streamed to `on_text`."""
    import torch
    from transformers import TextStreamer

    tok = chat.tokenizer
    for message in messages:
        check_text(message["content"], "--prompt / stdin" if message["role"] == "user" else f"--{message['role']}")
    ids = _encode(chat, messages)
    positions = _positions(chat.model)
    if positions is not None and len(ids) >= positions:
        raise UserError("the conversation is longer than the model can read", [Problem(
            "--prompt / stdin", f"it is {len(ids)} tokens; the model has {positions} positions",
            "ask something shorter, or start a new conversation")])
    if positions is not None:
        max_new_tokens = min(max_new_tokens, positions - len(ids))
    input_ids = torch.tensor([ids], device=chat.model.device)
    inputs = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}

    class Streamer(TextStreamer):
        def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
            if on_text is not None and text:
                on_text(text)

    sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
    with torch.no_grad():
        out = chat.model.generate(**inputs, max_new_tokens=max_new_tokens, eos_token_id=chat.stops or None,
                                  pad_token_id=(chat.stops or [tok.pad_token_id or 0])[0],
                                  streamer=Streamer(tok, skip_prompt=True, skip_special_tokens=True), **sampling)
    return tok.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip()
