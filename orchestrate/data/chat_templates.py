"""The named chat templates `data.chat_template` may give (chatml, llama-3, mistral, phi-3, gemma,
zephyr, alpaca) and the names users type for them (`ALIASES`: llama3, llama-3.1, qwen2.5, ...).

Each follows its family's published turn format (the model cards and tokenizer_config.json files of
Qwen2-Instruct, Meta-Llama-3-Instruct, Mistral-7B-Instruct, Phi-3-mini-instruct, Gemma-it and
HuggingFaceH4/zephyr-7b-beta; Alpaca's as Axolotl writes it as a chat template,
src/axolotl/utils/chat_templates/templates/alpaca.jinja): the same header, end-of-turn and BOS
tokens, so a tokenizer of that family encodes a conversation as the family's own template would.
Written here (not copied), with two deliberate choices:

- every assistant turn is wrapped in `{% generation %}` ... `{% endgeneration %}`, content plus its
  end-of-turn token, so transformers' `apply_chat_template(..., return_assistant_tokens_mask=True)`
  marks exactly the tokens the loss trains (docs/sft.md); the newline after the end-of-turn token is
  outside (the model stops at the token and never has to produce it);
- no default system prompt is invented (Qwen2's template adds one, Qwen2.5's "You are Qwen, created
  by Alibaba Cloud...", Llama 3.1's a knowledge-cutoff header, Stanford Alpaca's prompt its "Below
  is an instruction..." preamble): the aliases name the family's turn format, not those defaults.

Templates without a system role (Mistral, Gemma) put the system message in front of the first user
turn, as Mistral's v0.3 and Gemma 3's templates do. Tool results are passed through as their own turn
(`tool`; Llama 3.1 calls that role `ipython`), tool calls of an assistant turn rendered as JSON.

`special_tokens`, `bos`, `eos`: what `orchestrate tokenizer train` gives a tokenizer it trains for the
template (eos is the token a reply ends with, where generation stops).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NamedTemplate:
    name: str
    source: str
    special_tokens: tuple[str, ...]
    bos: str | None
    eos: str


# `content` of a message, '' when the message has none (transformers drops None-valued keys).
_CONTENT = "{%- set content = message.content if message.content is defined else '' -%}"
_TOOL_CALLS = ("{%- for call in (message.tool_calls if message.tool_calls is defined else []) -%}"
               "{{ '\\n<tool_call>\\n' + (call | tojson) + '\\n</tool_call>' }}{%- endfor -%}")

CHATML = NamedTemplate(
    "chatml",
    "{%- for message in messages -%}" + _CONTENT +
    "{{- '<|im_start|>' + message.role + '\\n' -}}"
    "{%- if message.role == 'assistant' -%}"
    "{%- generation -%}{{- content -}}" + _TOOL_CALLS + "{{- '<|im_end|>' -}}{%- endgeneration -%}"
    "{%- else -%}{{- content + '<|im_end|>' -}}{%- endif -%}"
    "{{- '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}",
    ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), None, "<|im_end|>")

LLAMA3 = NamedTemplate(
    "llama-3",
    "{{- bos_token -}}"
    "{%- for message in messages -%}" + _CONTENT +
    "{%- set role = 'ipython' if message.role == 'tool' else message.role -%}"
    "{{- '<|start_header_id|>' + role + '<|end_header_id|>\\n\\n' -}}"
    "{%- if message.role == 'assistant' -%}"
    "{%- generation -%}{{- content | trim -}}" + _TOOL_CALLS + "{{- '<|eot_id|>' -}}{%- endgeneration -%}"
    "{%- else -%}{{- (content | trim) + '<|eot_id|>' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- endif -%}",
    ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
    "<|begin_of_text|>", "<|eot_id|>")

MISTRAL = NamedTemplate(
    "mistral",
    "{{- bos_token -}}"
    "{%- set system = messages[0].content if messages and messages[0].role == 'system' else '' -%}"
    "{%- set first_user = namespace(pending=true) -%}"
    "{%- for message in messages if message.role != 'system' -%}" + _CONTENT +
    "{%- if message.role == 'user' -%}"
    "{%- set text = (system + '\\n\\n' + content) if (system and first_user.pending) else content -%}"
    "{%- set first_user.pending = false -%}"
    "{{- '[INST] ' + text + ' [/INST]' -}}"
    "{%- elif message.role == 'assistant' -%}"
    "{%- generation -%}{{- content -}}" + _TOOL_CALLS + "{{- eos_token -}}{%- endgeneration -%}"
    "{%- else -%}{{- '[TOOL_RESULTS] ' + content + ' [/TOOL_RESULTS]' -}}{%- endif -%}"
    "{%- endfor -%}",
    ("<s>", "</s>", "[INST]", "[/INST]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"), "<s>", "</s>")

PHI3 = NamedTemplate(
    "phi-3",
    "{%- for message in messages -%}" + _CONTENT +
    "{{- '<|' + message.role + '|>\\n' -}}"
    "{%- if message.role == 'assistant' -%}"
    "{%- generation -%}{{- content -}}" + _TOOL_CALLS + "{{- '<|end|>' -}}{%- endgeneration -%}"
    "{%- else -%}{{- content + '<|end|>' -}}{%- endif -%}"
    "{{- '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}",
    ("<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|end|>"), None, "<|end|>")

GEMMA = NamedTemplate(
    "gemma",
    "{{- bos_token -}}"
    "{%- set system = messages[0].content if messages and messages[0].role == 'system' else '' -%}"
    "{%- set first_user = namespace(pending=true) -%}"
    "{%- for message in messages if message.role != 'system' -%}" + _CONTENT +
    "{%- set role = 'model' if message.role == 'assistant' else message.role -%}"
    "{{- '<start_of_turn>' + role + '\\n' -}}"
    "{%- if message.role == 'assistant' -%}"
    "{%- generation -%}{{- content | trim -}}" + _TOOL_CALLS + "{{- '<end_of_turn>' -}}{%- endgeneration -%}"
    "{%- else -%}"
    "{%- set text = (system + '\\n\\n' + content) if (system and message.role == 'user' and first_user.pending) "
    "else content -%}"
    "{%- if message.role == 'user' -%}{%- set first_user.pending = false -%}{%- endif -%}"
    "{{- (text | trim) + '<end_of_turn>' -}}{%- endif -%}"
    "{{- '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}",
    ("<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"), "<bos>", "<end_of_turn>")

# zephyr-7b-beta's tokenizer_config.json: every turn "<|role|>\n" + content + eos_token + "\n", the
# generation prompt "<|assistant|>\n" (its roles are plain text in that tokenizer, atomic in ours).
ZEPHYR = NamedTemplate(
    "zephyr",
    "{%- for message in messages -%}" + _CONTENT +
    "{{- '<|' + message.role + '|>\n' -}}"
    "{%- if message.role == 'assistant' -%}"
    "{%- generation -%}{{- content -}}" + _TOOL_CALLS + "{{- eos_token -}}{%- endgeneration -%}"
    "{%- else -%}{{- content + eos_token -}}{%- endif -%}"
    "{{- '\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\n' -}}{%- endif -%}",
    ("<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>"), "<s>", "</s>")

# Axolotl's alpaca.jinja: BOS, the system text as it is, "### Instruction:\n" + a user turn,
# "### Response:\n" + an answer + eos_token, turns apart by a blank line, the generation prompt
# "\n\n### Response:\n". A tool result is Stanford Alpaca's "### Input:" (context for the answer).
ALPACA = NamedTemplate(
    "alpaca",
    "{{- bos_token -}}"
    "{%- for message in messages -%}" + _CONTENT +
    "{%- if not loop.first -%}{{- '\n\n' -}}{%- endif -%}"
    "{%- if message.role == 'assistant' -%}"
    "{{- '### Response:\n' -}}"
    "{%- generation -%}{{- content -}}" + _TOOL_CALLS + "{{- eos_token -}}{%- endgeneration -%}"
    "{%- elif message.role == 'user' -%}{{- '### Instruction:\n' + content -}}"
    "{%- elif message.role == 'tool' -%}{{- '### Input:\n' + content -}}"
    "{%- else -%}{{- content -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '\n\n### Response:\n' -}}{%- endif -%}",
    ("<s>", "</s>"), "<s>", "</s>")

NAMED_TEMPLATES: dict[str, NamedTemplate] = {t.name: t for t in (CHATML, LLAMA3, MISTRAL, PHI3, GEMMA, ZEPHYR, ALPACA)}

ALIASES: dict[str, str] = {
    **dict.fromkeys(("qwen", "qwen2", "qwen-2", "qwen2.5", "qwen-2.5", "qwen_25"), "chatml"),
    **dict.fromkeys(("llama3", "llama-3.1", "llama3.1", "llama-3.2", "llama3.2", "llama-3.3", "llama3.3"), "llama-3"),
    **dict.fromkeys(("mixtral", "mistral_v1"), "mistral"),
    **dict.fromkeys(("phi3", "phi_3", "phi-3.5", "phi3.5", "phi_35"), "phi-3"),
    **dict.fromkeys(("gemma2", "gemma-2", "gemma3", "gemma-3"), "gemma"),
}
"""Names users type (model names, and Axolotl's `chat_template` names: qwen_25, phi_3, phi_35,
mistral_v1) for the families whose turn format a named template writes. Not Qwen3 (its template drops
earlier turns' reasoning), nor Phi-4 (<|im_sep|>), nor Llama 2 (<<SYS>>): other formats."""


def named_template(name: str) -> NamedTemplate | None:
    """The named template `name` (a name or an alias, any case) stands for; None for another name."""
    key = name.strip().lower()
    return NAMED_TEMPLATES.get(ALIASES.get(key, key))


def known_names() -> str:
    """The names and aliases, for the message of an unknown one."""
    return f"{', '.join(NAMED_TEMPLATES)} (also {', '.join(ALIASES)})"
