"""A fix line for every pydantic validation error: what to write instead, in YAML terms."""

from __future__ import annotations

from typing import Any

_BY_TYPE = {
    "int_type": "write a whole number without quotes, e.g. 512 (true/false and 8.0 are not integers)",
    "int_from_float": "write a whole number without a decimal point, e.g. 512",
    "float_type": "write a number without quotes, e.g. 0.001 or 1e-3 (true/false are not numbers)",
    "finite_number": "write a finite number (.inf and .nan are not allowed)",
    "bool_type": "write true or false, without quotes (1, 0, \"yes\" are not booleans)",
    "string_type": "write text; quote it if it looks like a number or a boolean, e.g. \"123\"",
    "list_type": "write a list, e.g. [a, b]",
    "tuple_type": "write a list of the expected length, e.g. [0.9, 0.95]",
    "dict_type": "write a mapping, e.g. {key: value}",
    "model_type": "write a mapping of this section's keys (`orchestrate schema` lists them)",
    "model_attributes_type": "write a mapping of this section's keys (`orchestrate schema` lists them)",
    "too_short": "give the expected number of items",
    "too_long": "give the expected number of items",
}

_BOUNDS = {"greater_than": ("gt", ">"), "greater_than_equal": ("ge", ">="),
           "less_than": ("lt", "<"), "less_than_equal": ("le", "<=")}


_BY_KEY = {
    "betas": "give two numbers from 0 up to (not including) 1, e.g. [0.9, 0.95]",
    "architecture": "fix the fields named above (transformers' config names, e.g. GPT2Config's n_embd)",
    "model": "give one of `name_or_path: DIR`, `architecture: {model_type: ...}` or `module: pkg.mod:Class`",
    "module": "write \"package.module:ClassOrFactory\", e.g. \"my_models.cnn:CNN\"",
    "micro_batch_size": "give a positive whole number or auto",
    "num_proc": "give a positive whole number or auto",
    "zero_stage": "give 0, 1, 2, 3 or auto",
    "last_turn_only": "set train_on_inputs: false to train the last answer only, or last_turn_only: false",
    "num_epochs": "keep one of train.max_steps (optimizer steps) and train.num_epochs (passes over the data); "
                  "`--set train.max_steps=null` clears the file's max_steps",
}


def fix_for(err: dict[str, Any]) -> str:
    """The fix line of one entry of `ValidationError.errors()`."""
    kind = err["type"]
    key = next((str(p) for p in reversed(err["loc"]) if str(p) in _BY_KEY), None)
    if kind == "value_error" and key is not None:
        return _BY_KEY[key]
    if kind in _BOUNDS:
        key, op = _BOUNDS[kind]
        return f"use a value {op} {err.get('ctx', {}).get(key)}"
    if kind == "literal_error":
        return f"use one of: {err.get('ctx', {}).get('expected', 'the values `orchestrate schema` lists')}"
    return _BY_TYPE.get(kind, "see this key's type and valid range in `orchestrate schema`")
