"""`orchestrate chat RUN_DIR [--prompt TEXT]`: talk to what a run trained, in this process on the CPU
(or the first GPU), streaming the reply.

It loads RUN_DIR/model (the trained or merged model), or with `--adapter` (and by default when a LoRA
/ QLoRA run has no RUN_DIR/model) the frozen base as training held it (RUN_DIR/init_model or
model.name_or_path: NF4 for QLoRA, `model/adapter_loading.py`) plus RUN_DIR/adapter through
`PeftModel.from_pretrained`. The tokenizer and chat template are the ones saved next to it; the
conversation is rendered with `add_generation_prompt=True` and the reply ends at EOS or at the
template's end-of-turn token (the token trained after every answer). Without a chat template (a
plain-text or prompt-completion run) the prompt is continued as text.

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
from orchestrate.errors import Problem, UserError
from orchestrate.planner.plan import RunPlan
from orchestrate.run.layout import RunDir


@dataclass
class ChatModel:
    model: Any
    tokenizer: Any
    stops: list[int]
    source: Path
    """The directory the weights (or the adapter) came from."""

    @property
    def has_template(self) -> bool:
        return bool(self.tokenizer.chat_template)


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
    the bounded sandbox), or the last message as plain text."""
    tok = chat.tokenizer
    if not chat.has_template:
        return tok(messages[-1]["content"])["input_ids"]
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


def load_chat_model(run_dir: Path, adapter: bool | None = None) -> ChatModel:
    """The run's model (or base + adapter, see the module doc) with its saved tokenizer, in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    from orchestrate.data.tokenizer import auto_tokenizer

    run = RunDir(Path(run_dir))
    plan = _plan(run)
    trust = plan.config.model.trust_remote_code
    use_adapter = adapter if adapter is not None else not run.model.is_dir() and run.adapter.is_dir()
    source = run.adapter if use_adapter else run.model
    if not (source / ("adapter_config.json" if use_adapter else "config.json")).is_file():
        what = "adapter (a LoRA / QLoRA run's RUN_DIR/adapter)" if use_adapter else "model (RUN_DIR/model)"
        raise UserError(f"the run has no trained {what}", [Problem(
            "RUN_DIR", f"{source} is missing or incomplete", "let the run finish (or `orchestrate export` a "
            "checkpoint and chat with that run), or choose the other one (--adapter / --model)")])
    tok = auto_tokenizer(source, trust)
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
                    *(_end_of_turn(tok) if tok.chat_template else [])})
    return ChatModel(model, tok, stops, source)


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
