"""`orchestrate chat RUN_DIR [--prompt TEXT]`: talk to what a run trained, in this process on the CPU
(or the first GPU), streaming the reply.

It loads RUN_DIR/model (the trained or merged model), or with `--adapter` (and by default when a LoRA
/ QLoRA run has no RUN_DIR/model) the frozen base as training held it (RUN_DIR/init_model or
model.name_or_path: NF4 for QLoRA, `model/adapter_loading.py`) plus RUN_DIR/adapter through
`PeftModel.from_pretrained`. The tokenizer and chat template are the ones saved next to it; the
conversation is rendered with `add_generation_prompt=True` and the reply ends at EOS or at the
template's end-of-turn token (the token trained after every answer). Without a chat template (a
plain-text or prompt-completion run) the prompt is continued as text.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


def _end_of_turn(tok) -> list[int]:
    """The token the template ends an assistant turn with, when it is a special token of the tokenizer."""
    from orchestrate.data.chat_template import ChatTemplate
    from orchestrate.data.sft_tokens import encode_chat

    probe = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    encoded = encode_chat(tok, ChatTemplate(tok.chat_template, "saved"), probe, ["assistant"], False)
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
    if chat.has_template:
        inputs = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                         return_tensors="pt")
    else:
        inputs = tok(messages[-1]["content"], return_tensors="pt")
    inputs = {k: v.to(chat.model.device) for k, v in inputs.items() if k in ("input_ids", "attention_mask")}

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
