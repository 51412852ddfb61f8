"""Which chat template renders a run's conversations: the YAML's `data.chat_template` (a name of
`chat_templates.NAMED_TEMPLATES`, a .jinja file, or inline Jinja), else the tokenizer's own.

The template runs in transformers' sandboxed Jinja environment (`apply_chat_template`), so a template
from the YAML is no code opt-in: it can format strings, not import or call anything.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from orchestrate.data.chat_templates import NAMED_TEMPLATES
from orchestrate.errors import Problem, UserError

if TYPE_CHECKING:
    from orchestrate.config.schema import RunConfig

_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")
"""transformers' own test for `{% generation %}` markers (utils/chat_template_utils.py render_jinja_template)."""
_NAMES = ", ".join(NAMED_TEMPLATES)


@dataclass(frozen=True)
class ChatTemplate:
    source: str
    """The Jinja text."""
    origin: str
    """Where it came from, for messages: "the tokenizer's own", "chatml", "inline", a file path."""

    @property
    def has_generation_markers(self) -> bool:
        """Whether the assistant turns are marked: then transformers' `return_assistant_tokens_mask`
        gives the trained tokens; otherwise they are found by rendering the conversation turn by turn."""
        return bool(_GENERATION.search(self.source))


def yaml_template(config: RunConfig) -> ChatTemplate | None:
    """`data.chat_template` as Jinja text (None when the YAML gives none)."""
    given = config.data.chat_template
    if given is None:
        return None
    if "{{" in given or "{%" in given:
        return ChatTemplate(given, "inline")
    if given in NAMED_TEMPLATES:
        return ChatTemplate(NAMED_TEMPLATES[given].source, given)
    path = config.resolve_path(given)
    if path.suffix == ".jinja" or path.is_file():
        try:
            return ChatTemplate(path.read_text(encoding="utf-8"), str(path))
        except (OSError, UnicodeDecodeError) as exc:
            raise UserError("the chat template file cannot be read", [Problem(
                "data.chat_template", f"{path}: {exc}", "point it at a readable .jinja file")]) from None
    raise UserError("unknown chat template", [Problem(
        "data.chat_template", f"{given!r} is no template name and no file",
        f"use one of {_NAMES}, a .jinja file, or inline Jinja ({{% for message in messages %}}...)")])


def saved_chat_template(config: RunConfig) -> str | None:
    """The template saved with the run's tokenizer: the YAML's (the tokenizer's own is in its files)."""
    given = yaml_template(config)
    return given.source if given is not None else None


def chat_template_for(config: RunConfig, hf_tokenizer) -> ChatTemplate:
    """The template of chat records: the YAML's, else the tokenizer's own (`resolve_template`)."""
    return resolve_template(yaml_template(config), hf_tokenizer)


def resolve_template(given: ChatTemplate | None, hf_tokenizer) -> ChatTemplate:
    """`given` (the YAML's), else the tokenizer's own; one error with the fix when there is neither.
    `hf_tokenizer`: a transformers tokenizer, None for the byte tokenizer."""
    if given is not None:
        return given
    own = getattr(hf_tokenizer, "chat_template", None) if hf_tokenizer is not None else None
    if isinstance(own, dict):  # named templates (e.g. "default", "tool_use"): the default one
        own = own.get("default")
    if own:
        return ChatTemplate(own, "the tokenizer's own")
    where = "data.tokenizer" if hf_tokenizer is not None else "data.chat_template"
    have = "the tokenizer has no chat_template" if hf_tokenizer is not None else "the built-in byte tokenizer has none"
    raise UserError("chat records need a chat template", [Problem(
        where, f"{have}, and data.chat_template gives none",
        f"set data.chat_template to one of {_NAMES} (the one of the model's family), a .jinja file or inline "
        "Jinja, or use a tokenizer that carries a chat_template")])
