"""The shape of a frozen model a method runs beside the trained one (distillation's teacher, a
preference reference): launcher side, read from its config.json and tokenizer files, never weights,
and checked against the trained model's vocabulary and tokenizer. What such a model costs is the
planner's (orchestrate/planner/auxiliary.py).
"""

from __future__ import annotations

from pathlib import Path

from orchestrate.config.model import ModelSection
from orchestrate.config.schema import RunConfig
from orchestrate.errors import Problem, UserError
from orchestrate.model.meta import shape_for
from orchestrate.model.shape import ModelShape

_TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer_config.json")


def frozen_model_shape(config: RunConfig, trained: ModelShape, path: Path, where: str, role: str,
                       fix_same: str) -> ModelShape:
    """The shape of a frozen model a method runs beside the trained one (distillation's teacher, a
    preference reference) at `path` (YAML `where`); UserError listing every problem: no such directory,
    a vocabulary or tokenizer that differs from the trained model's (`fix_same`: how to make them one)."""
    if not (path / "config.json").is_file():
        raise UserError(f"the {role} is not a model directory", [Problem(
            where, f"{path} has no config.json",
            f"point {where} at a Hugging Face model directory (e.g. RUN_DIR/model of the {role}'s run)")])
    shape = shape_for(_as_model(config, path))
    problems = []
    if shape.vocab_size != trained.vocab_size:
        problems.append(Problem(where, f"the {role}'s vocabulary has {shape.vocab_size} ids "
                                f"({path / 'config.json'}), the trained model's {trained.vocab_size}", fix_same))
    problems += _tokenizer_problems(config, path, where, role, fix_same)
    if problems:
        raise UserError(f"the {role} and the trained model do not share a tokenizer and vocabulary", problems)
    return shape


def _as_model(config: RunConfig, path: Path) -> RunConfig:
    model = ModelSection(name_or_path=str(path), task=config.model.task,
                         trust_remote_code=config.model.trust_remote_code)
    return config.model_copy(update={"model": model})


def _vocab(tokenizer_dir: Path | None, trust_remote_code: bool) -> dict[str, int]:
    # Imported here: the tokenizers bring numpy, which no plan without a frozen model needs.
    from orchestrate.data.tokenizer import auto_tokenizer, byte_tokenizer_fast

    tok = byte_tokenizer_fast() if tokenizer_dir is None else auto_tokenizer(tokenizer_dir, trust_remote_code)
    return tok.get_vocab()


def _tokenizer_problems(config: RunConfig, path: Path, where: str, role: str, fix_same: str) -> list[Problem]:
    from orchestrate.data.tokenizer_choice import tokenizer_dir_of  # numpy, as in _vocab

    if not any((path / name).is_file() for name in _TOKENIZER_MARKERS):
        return [Problem(where, f"{path} has no tokenizer (tokenizer.json or tokenizer_config.json) to "
                        f"compare with the trained model's", f"copy the {role}'s tokenizer files into its directory "
                        "(orchestrate saves them next to RUN_DIR/model)")]
    trained_dir = tokenizer_dir_of(config)
    trust = config.model.trust_remote_code
    trained, other = _vocab(trained_dir, trust), _vocab(path, trust)
    if trained == other:
        return []
    differ = sorted(set(trained.items()) ^ set(other.items()))[:3]
    tok_where = "data.tokenizer" if trained_dir is not None else "data.tokenizer (null: the built-in byte tokenizer)"
    return [Problem(tok_where, f"the trained model's tokenizer ({trained_dir or 'byte tokenizer'}, {len(trained)} tokens) "
                    f"differs from the {role}'s ({path}, {len(other)} tokens), e.g. {differ}", fix_same)]
