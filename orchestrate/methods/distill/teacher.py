"""The distillation teacher as the planner sees it: its directory, its shape (from its config.json,
like the student's) and the check that teacher and student speak the same vocabulary. Launcher
side; reads config.json and tokenizer files, never weights."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from orchestrate.config.model import ModelSection
from orchestrate.errors import Problem, UserError
from orchestrate.model.meta import shape_for

if TYPE_CHECKING:
    from orchestrate.config.schema import RunConfig
    from orchestrate.model.shape import ModelShape

_TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer_config.json")
_FIX_SAME = ("distill from a teacher trained with the student's tokenizer (set data.tokenizer to the teacher's "
             "tokenizer directory, or train the teacher with this data section)")


def teacher_dir(config: RunConfig) -> Path:
    return config.resolve_path(config.distill.teacher)


def teacher_config(config: RunConfig) -> RunConfig:
    """`config` with the teacher as its model: what the worker builds the teacher from."""
    return _as_model(config, teacher_dir(config))


def teacher_shape(config: RunConfig, student: ModelShape) -> ModelShape:
    """The teacher's shape; UserError listing every problem: no such directory, another task, a
    vocabulary or tokenizer that differs from the student's (the KL compares the two distributions
    id by id, so id i must be the same token in both)."""
    if config.model.task != "causal-lm":
        raise UserError("distillation is planned for causal language models", [Problem(
            "distill", f"model.task is {config.model.task}; the soft-target loss compares next-token distributions",
            "remove distill, or use model.task: causal-lm")])
    return frozen_model_shape(config, student, teacher_dir(config), "distill.teacher", "teacher", _FIX_SAME)


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
    from orchestrate.data.tokenizer import auto_tokenizer, byte_tokenizer_fast

    tok = byte_tokenizer_fast() if tokenizer_dir is None else auto_tokenizer(tokenizer_dir, trust_remote_code)
    return tok.get_vocab()


def _tokenizer_problems(config: RunConfig, path: Path, where: str, role: str, fix_same: str) -> list[Problem]:
    from orchestrate.data.tokenizer_choice import tokenizer_dir_of

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
