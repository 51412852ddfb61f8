"""`data.template`: literal text with plain `{column}` fields, one document per record.

Only plain fields: a format spec (`{text:>999999999}` pads to a gigabyte per record), a conversion
(`{text!r}`), indexing (`{text[100000]}`) or attribute access (`{text.__class__.__mro__}`, which
renders Python's type reprs) would let a config compute instead of naming a column, so each is
refused with the YAML path. `{{` and `}}` are literal braces. A missing value (null) renders empty.
"""

from __future__ import annotations

import string

from orchestrate.errors import Problem, UserError

_FIX = "use plain {column} fields (and {{ }} for literal braces); no indexing, attributes, !conversions or :specs"


def template_fields(template: str) -> list[str]:
    """The columns `template` names; one UserError listing every field that is not a plain name."""
    try:
        parts = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise UserError("data.template is not a valid template", [Problem("data.template", str(exc), _FIX)]) from None
    names, bad = [], []
    for _, name, spec, conversion in parts:
        if name is None:  # literal text only
            continue
        field = "{" + name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "") + "}"
        if not name or name.isdigit():
            bad.append(f"{field} is positional, not a column name")
        elif any(c in name for c in ".["):
            bad.append(f"{field} indexes or reads an attribute")
        elif conversion:
            bad.append(f"{field} converts the value")
        elif spec:
            bad.append(f"{field} has a format spec")
        else:
            names.append(name)
    if bad:
        raise UserError("data.template may only name columns", [Problem("data.template", "; ".join(bad), _FIX)])
    return names


def render(template: str, record: dict) -> str:
    """The document of one record (its fields checked by `template_fields` and as text columns)."""
    return template.format_map({k: "" if v is None else v for k, v in record.items()})
