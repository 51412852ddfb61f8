"""Knowledge distillation (`distill:`): the model trains to match a frozen teacher's soft targets
(Hinton et al. 2015). An add-on method that composes with full fine-tuning and LoRA / QLoRA, owns the
objective and runs one auxiliary model, the teacher (orchestrate/methods/spec.py).

Its files: config.py (`distill:`), teacher.py (the teacher's directory and shape, with the
vocabulary check of methods/auxiliary.py, launcher side), memory.py (what the teacher's outputs take), objective.py (the loss), cache.py
(the precomputed placement's top-k cache), runtime.py (the worker half: the teacher stage and the
objective). Where the teacher lives is priced and built as any auxiliary model's placement
(orchestrate/planner/auxiliary.py, orchestrate/loading/auxiliary.py).
"""

from __future__ import annotations

from orchestrate.config.schema import RunConfig
from orchestrate.hardware.profile import HardwareProfile
from orchestrate.methods.distill.memory import teacher_model
from orchestrate.methods.distill.teacher import teacher_shape
from orchestrate.methods.spec import Method
from orchestrate.model.shape import ModelShape
from orchestrate.planner.auxiliary import AuxiliaryModel
from orchestrate.planner.terms import MethodTerms
from orchestrate.run.layout import TEACHER_CACHE_DIR

TEACHER = "teacher"


def distill_terms(teacher: AuxiliaryModel | None) -> MethodTerms:
    """A distillation plan: the teacher as an auxiliary model (None: planned without its shape, a remedy's
    re-plan); the KL needs the student's whole logits, so the loss is never chunked, and its objective
    reads whole sequences (the worker refuses a sequence split)."""
    return MethodTerms(chunks_loss=False, splits_sequence=False, auxiliary=(teacher,) if teacher is not None else ())


class Distill(Method):
    name = "distill"
    bases = ("full", "lora")
    objective = True
    runtime = "orchestrate.methods.distill.runtime"
    saves = (TEACHER_CACHE_DIR,)

    def active(self, config: RunConfig) -> bool:
        return config.distill is not None

    def auxiliary_shapes(self, config: RunConfig, shape: ModelShape) -> dict[str, ModelShape]:
        return {TEACHER: teacher_shape(config, shape)}

    def terms(self, config: RunConfig, shape: ModelShape, hw: HardwareProfile,
              auxiliary: dict[str, ModelShape]) -> MethodTerms:
        if TEACHER not in auxiliary:
            return distill_terms(None)
        return distill_terms(teacher_model(auxiliary[TEACHER], config.distill.placement, config.distill.top_k))


DISTILL = Distill()
