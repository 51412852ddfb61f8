"""The distillation teacher as the planner sees it: its directory, its shape (from its config.json,
like the student's) and the check that teacher and student speak the same vocabulary. Launcher
side; reads config.json and tokenizer files, never weights."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from orchestrate.errors import Problem, UserError

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
    from orchestrate.config.model import ModelSection

    model = ModelSection(name_or_path=str(teacher_dir(config)), task=config.model.task,
                         trust_remote_code=config.model.trust_remote_code)
    return config.model_copy(update={"model": model})


def teacher_shape(config: RunConfig, student: ModelShape) -> ModelShape:
    """The teacher's shape; UserError listing every problem: no such directory, another task, a
    vocabulary or tokenizer that differs from the student's (the KL compares the two distributions
    id by id, so id i must be the same token in both)."""
    from orchestrate.model.meta import shape_for

    path = teacher_dir(config)
    if config.model.task != "causal-lm":
        raise UserError("distillation is planned for causal language models", [Problem(
            "distill", f"model.task is {config.model.task}; the soft-target loss compares next-token distributions",
            "remove distill, or use model.task: causal-lm")])
    if not (path / "config.json").is_file():
        raise UserError("the distillation teacher is not a model directory", [Problem(
            "distill.teacher", f"{path} has no config.json",
            "point distill.teacher at a Hugging Face model directory (e.g. RUN_DIR/model of the teacher's run)")])
    shape = shape_for(teacher_config(config))
    problems = []
    if shape.vocab_size != student.vocab_size:
        problems.append(Problem("distill.teacher", f"the teacher's vocabulary has {shape.vocab_size} ids "
                                f"({path / 'config.json'}), the student's {student.vocab_size}", _FIX_SAME))
    problems += _tokenizer_problems(config, path)
    if problems:
        raise UserError("teacher and student do not share a tokenizer and vocabulary", problems)
    return shape


def _vocab(tokenizer_dir: Path | None, trust_remote_code: bool) -> dict[str, int]:
    from orchestrate.data.tokenizer import auto_tokenizer, byte_tokenizer_fast

    tok = byte_tokenizer_fast() if tokenizer_dir is None else auto_tokenizer(tokenizer_dir, trust_remote_code)
    return tok.get_vocab()


def _tokenizer_problems(config: RunConfig, path: Path) -> list[Problem]:
    from orchestrate.data.tokenizer_choice import tokenizer_dir_of

    if not any((path / name).is_file() for name in _TOKENIZER_MARKERS):
        return [Problem("distill.teacher", f"{path} has no tokenizer (tokenizer.json or tokenizer_config.json) to "
                        "compare with the student's", "copy the teacher's tokenizer files into its directory "
                        "(orchestrate saves them next to RUN_DIR/model)")]
    student_dir = tokenizer_dir_of(config)
    trust = config.model.trust_remote_code
    student, teacher = _vocab(student_dir, trust), _vocab(path, trust)
    if student == teacher:
        return []
    differ = sorted(set(student.items()) ^ set(teacher.items()))[:3]
    where = "data.tokenizer" if student_dir is not None else "data.tokenizer (null: the built-in byte tokenizer)"
    return [Problem(where, f"the student's tokenizer ({student_dir or 'byte tokenizer'}, {len(student)} tokens) "
                    f"differs from the teacher's ({path}, {len(teacher)} tokens), e.g. {differ}", _FIX_SAME)]
