"""Which chat template renders a run's conversations: the YAML's `data.chat_template` (a name of
`chat_templates.NAMED_TEMPLATES` or one of its `ALIASES`, a .jinja file, or inline Jinja), else the
tokenizer's own.

The template runs in a bounded copy of transformers' sandboxed Jinja environment (`render`): it can
format strings, not import or call anything, so a template from the YAML is no code opt-in; and a
render is held to a wall-clock budget, a call depth, and an output size (`RENDER_SECONDS`,
`CALL_DEPTH`, `OUTPUT_CHARS`), so a template that loops, recurses or multiplies strings without end
is refused with one error naming the template and the limit (`TemplateLimit`) instead of hanging or
exhausting memory. `include` / `import` / `extends` find no loader and are refused the same way.
"""

from __future__ import annotations

import functools
import re
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from orchestrate.data.chat_templates import known_names, named_template
from orchestrate.errors import Problem, UserError

if TYPE_CHECKING:
    from orchestrate.config.schema import RunConfig

_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")
"""transformers' own test for `{% generation %}` markers (utils/chat_template_utils.py render_jinja_template)."""
_NAMES = known_names()
RENDER_SECONDS = 10.0
"""Wall-clock budget of one render: real templates render a conversation in milliseconds."""
CALL_DEPTH = 64
"""Nested calls (macros calling macros) one render may make."""
OUTPUT_CHARS = 64 * 2**20
"""Characters one render may produce, and the largest string a `*` or a call's size argument may ask for."""
FILE_BYTES = 1 << 20
"""The largest .jinja file read: real chat templates are a few KiB (Llama-3's tool template about 5)."""


class TemplateLimit(jinja2.exceptions.SecurityError):
    """A render went past one of the limits above, or asked for a template file (include / import)."""


class TemplateFailed(jinja2.exceptions.TemplateRuntimeError):
    """The template raised something other than a template error (`{{ 1 + 'a' }}`: TypeError, ...):
    the template's fault, reported as its error rather than as a crash."""


class _Budget(threading.local):
    """The running render's deadline and call depth (per thread: a render is one thread's)."""

    deadline: float = float("inf")
    depth: int = 0

    def check(self) -> None:
        if time.monotonic() > self.deadline:
            raise TemplateLimit(f"it ran longer than {RENDER_SECONDS:g} s (a loop without end?)")


_BUDGET = _Budget()


def _size_check(values) -> None:
    for value in values:
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > OUTPUT_CHARS:
            raise TemplateLimit(f"it asked for a size of {value} (more than {OUTPUT_CHARS} characters)")


class _RefusingLoader(jinja2.BaseLoader):
    def get_source(self, environment, template):
        raise TemplateLimit(f"it includes or imports {template!r}: a chat template must be one self-contained file")


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox with every call, attribute, loop over `range` and `*` checked against the budget."""

    intercepted_binops = frozenset({"*"})

    def call_binop(self, context, operator, left, right):
        _BUDGET.check()
        if operator == "*":
            count, item = (left, right) if isinstance(left, int) else (right, left)
            if isinstance(item, (str, list, tuple)) and isinstance(count, int) and count * max(len(item), 1) > OUTPUT_CHARS:
                raise TemplateLimit(f"it multiplies a string or list to more than {OUTPUT_CHARS} items")
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja's own signature
        """Every call and macro call: the budget, its arguments' sizes (`'x'.ljust(n)`), the depth."""
        _BUDGET.check()
        _size_check((*args, *kwargs.values()))
        if _BUDGET.depth >= CALL_DEPTH:
            raise TemplateLimit(f"it nests calls deeper than {CALL_DEPTH} (a recursive macro?)")
        _BUDGET.depth += 1
        try:
            return super().call(__context, __obj, *args, **kwargs)
        finally:
            _BUDGET.depth -= 1

    def getattr(self, obj, attribute):
        _BUDGET.check()
        return super().getattr(obj, attribute)

    def getitem(self, obj, argument):
        _BUDGET.check()
        return super().getitem(obj, argument)


def _bounded_range(*args: int):
    """`range` as a generator that checks the budget at every step (nested loops end in time)."""
    for i in range(*args):
        _BUDGET.check()
        yield i


def _bounded_filter(f):
    """`f` checking the budget, and the size of its arguments after the value filtered (`center(n)`)."""
    value = 2 if getattr(f, "jinja_pass_arg", None) is not None else 1  # after the context it is passed

    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        _BUDGET.check()
        _size_check((*args[value:], *kwargs.values()))
        return f(*args, **kwargs)
    return wrapper


@functools.lru_cache(maxsize=16)
def _compiled(source: str) -> jinja2.Template:
    """`source` compiled in the bounded environment, with what transformers' chat-template environment
    adds (its `{% generation %}` tracker, loop controls, tojson, raise_exception, namespace, ...)."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    reference = _compile_jinja_template("").environment
    env = _BoundedEnvironment(trim_blocks=True, lstrip_blocks=True, loader=_RefusingLoader(),
                              extensions=[type(e) for e in reference.extensions.values()])
    env.filters.update({name: _bounded_filter(f) for name, f in {**env.filters, **reference.filters}.items()})
    env.globals.update({k: v for k, v in reference.globals.items() if k != "range"}, range=_bounded_range)
    return env.from_string(source)


def render(template: ChatTemplate, tok, messages: list[dict[str, Any]], generation_prompt: bool,
           ) -> tuple[str, list[tuple[int, int]]]:
    """(the conversation rendered by `template`, the character spans of its `{% generation %}` blocks),
    as transformers' `apply_chat_template(tokenize=False)` renders it, within the limits of the module
    docstring. Raises TemplateLimit past one; the template's own errors (raise_exception, syntax) as
    jinja's, and anything else its expressions raise as TemplateFailed: every failure a TemplateError."""
    from transformers.utils.chat_template_utils import _plain_template_data

    _BUDGET.deadline, _BUDGET.depth = time.monotonic() + RENDER_SECONDS, 0
    blocks: list[str] = []
    spans: list[tuple[int, int]] = []
    try:
        compiled = _compiled(template.source)
        size = 0
        with compiled.environment.activate_tracker(blocks, spans):
            for block in compiled.generate(messages=_plain_template_data(messages), tools=None, documents=None,
                                           add_generation_prompt=generation_prompt,
                                           **_plain_template_data(tok.special_tokens_map)):
                size += len(block)
                if size > OUTPUT_CHARS:
                    raise TemplateLimit(f"it renders more than {OUTPUT_CHARS} characters")
                _BUDGET.check()
                blocks.append(block)
    except RecursionError:
        raise TemplateLimit("it recurses without end") from None
    except MemoryError:
        raise TemplateLimit("it ran out of memory") from None
    except jinja2.TemplateError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever the template's own expressions raise
        raise TemplateFailed(f"{type(exc).__name__}: {exc}") from None
    finally:
        _BUDGET.deadline = float("inf")
    return "".join(blocks), spans


def limit_error(template: ChatTemplate, exc: BaseException | str, where: str = "data.chat_template") -> UserError:
    """One error for a template that hit a limit of `render` (or that the sandbox refused)."""
    return UserError("the chat template cannot be rendered", [Problem(
        where, f"{template.origin}: {exc}", "fix the template: chat templates render a conversation with plain "
        "loops over the messages, no include / import, no recursion and no large repetitions")])


@dataclass(frozen=True)
class ChatTemplate:
    source: str
    """The Jinja text."""
    origin: str
    """Where it came from, for messages: "the tokenizer's own", "chatml", "inline", a file path."""

    @property
    def has_generation_markers(self) -> bool:
        """Whether the assistant turns are marked: then the marked spans (`render`, as transformers'
        `return_assistant_tokens_mask` finds them) give the trained tokens; otherwise they are found by
        rendering the conversation turn by turn."""
        return bool(_GENERATION.search(self.source))


def yaml_template(config: RunConfig) -> ChatTemplate | None:
    """`data.chat_template` as Jinja text (None when the YAML gives none)."""
    given = config.data.chat_template
    if given is None:
        return None
    if "{{" in given or "{%" in given:
        return ChatTemplate(given, "inline")
    if (named := named_template(given)) is not None:
        return ChatTemplate(named.source, given if given == named.name else f"{given} ({named.name})")
    path = config.resolve_path(given)
    if path.suffix == ".jinja" or path.exists():
        return ChatTemplate(_read_template_file(path), str(path))
    raise UserError("unknown chat template", [Problem(
        "data.chat_template", f"{given!r} is no template name and no file",
        f"use one of {_NAMES}, a .jinja file, or inline Jinja ({{% for message in messages %}}...)")])


def _read_template_file(path: Path) -> str:
    """A .jinja file's text, checked before it is read: a regular file (a FIFO would block the read
    forever), at most FILE_BYTES, UTF-8."""
    fix = "point data.chat_template at a .jinja file of UTF-8 text (or give a template name, or inline Jinja)"
    try:
        st = path.stat()
        if not stat.S_ISREG(st.st_mode):
            problem = f"{path} is not a regular file (a pipe, socket, device or directory)"
        elif st.st_size > FILE_BYTES:
            problem = f"{path} holds {st.st_size:,} bytes; a chat template is a few KiB (at most {FILE_BYTES:,})"
        else:
            return path.read_bytes().decode("utf-8")
    except OSError as exc:
        problem = f"{path}: {exc.strerror or exc}"
    except UnicodeDecodeError as exc:
        problem = f"{path} is not UTF-8: byte {exc.start} ({exc.object[exc.start]:#04x}) is no UTF-8 character"
    raise UserError("the chat template file cannot be read", [Problem("data.chat_template", problem, fix)])


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
