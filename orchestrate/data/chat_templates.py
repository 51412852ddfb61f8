"""The named chat templates `data.chat_template` may give (chatml, llama-3, mistral, phi-3, gemma).

Each follows its family's published turn format (the model cards and tokenizer_config.json files of
Qwen2-Instruct, Meta-Llama-3-Instruct, Mistral-7B-Instruct, Phi-3-mini-instruct and Gemma-it): the
same header, end-of-turn and BOS tokens, so a tokenizer of that family encodes a conversation as the
family's own template would. Written here (not copied), with two deliberate choices:

- every assistant turn is wrapped in `{% generation %}` ... `{% endgeneration %}`, content plus its
  end-of-turn token, so transformers' `apply_chat_template(..., return_assistant_tokens_mask=True)`
  marks exactly the tokens the loss trains (docs/sft.md); the newline after the end-of-turn token is
  outside (the model stops at the token and never has to produce it);
- no default system prompt is invented (Qwen2's template adds one).

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

NAMED_TEMPLATES: dict[str, NamedTemplate] = {t.name: t for t in (CHATML, LLAMA3, MISTRAL, PHI3, GEMMA)}
