"""`train.eval_generate: N`: at every evaluation, the model answers N held-out chat / instruction
samples greedily and rank 0 adds to the step's record `eval_exact_match` (the share whose answer,
special tokens left out and stripped, equals the data's) and `eval_generations` (prompt, reference,
generated text). A MEASURE callback registered after `Evaluation`, on the same schedule.

Collective: every rank generates the same prompts. Under FSDP2 and ZeRO-3 each forward gathers
parameters from every rank, so the ranks must step together: `synced_gpus` keeps each rank
forwarding until all have stopped (transformers' generate). Stops at the tokens the references end
with (the template's end-of-turn token, trained after every answer) and at EOS.
"""

from __future__ import annotations

import itertools

from orchestrate.worker.callbacks.base import Callback, Phase, StepEnd, Training

_EXTRA_TOKENS = 8
"""New tokens allowed beyond the longest reference answer."""


def _text(tokenizer, ids: list[int]) -> str:
    hf = getattr(tokenizer, "tok", None)
    return (hf.decode(ids, skip_special_tokens=True) if hf is not None else tokenizer.decode(ids)).strip()


class EvalGenerate(Callback):
    phase = Phase.MEASURE

    def __init__(self) -> None:
        self.prompts: list[tuple[list[int], list[int]]] = []

    def on_train_start(self, training: Training) -> None:
        count, validation = training.plan.config.train.eval_generate, training.data.validation
        if count and hasattr(validation, "prompt_and_answer"):  # chat / instruction samples only
            cut = (validation.prompt_and_answer(k) for k in range(validation.samples))
            self.prompts = list(itertools.islice((pair for pair in cut if pair is not None), count))

    def on_step_end(self, training: Training, end: StepEnd) -> None:
        every = training.plan.config.train.eval_every
        if not self.prompts or (end.stopping and not end.final) or not ((every and end.step % every == 0) or end.final):
            return
        generated = self._generate(training)
        if not training.rank.is_main:
            return
        tok = training.data.tokenizer
        rows = [{"prompt": _text(tok, p), "reference": _text(tok, a), "generated": _text(tok, g)}
                for (p, a), g in zip(self.prompts, generated, strict=True)]
        end.add({"eval_exact_match": sum(r["reference"] == r["generated"] for r in rows) / len(rows),
                 "eval_generations": rows})

    def _generate(self, training: Training) -> list[list[int]]:
        import torch

        strategy, device = training.plan.strategy, training.rank.device
        sharded = strategy.backend == "fsdp" or (strategy.backend == "deepspeed" and strategy.zero_stage == 3)
        wrapper = training.engine.model
        model = wrapper if strategy.backend == "fsdp" else getattr(wrapper, "module", wrapper)
        stops = sorted({training.data.tokenizer.eos_id, *(a[-1] for _, a in self.prompts if a)})
        longest = max(len(a) for _, a in self.prompts) + _EXTRA_TOKENS
        out = []
        wrapper.eval()
        if strategy.backend == "fsdp":
            # generate calls the inner HF model, not FSDP2's root module, whose forward hook would gather the
            # root's own parameters (embeddings, final norm, head): gather them here (the blocks gather their own).
            wrapper.unshard()
        try:
            with torch.no_grad():
                for prompt, _ in self.prompts:
                    ids = torch.tensor([prompt], device=device)
                    new = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=longest,
                                         do_sample=False, eos_token_id=stops, pad_token_id=stops[0],
                                         synced_gpus=sharded and training.rank.world_size > 1)
                    out.append([t for t in new[0, len(prompt):].tolist() if t not in stops])
        finally:
            if strategy.backend == "fsdp":
                wrapper.reshard()
            wrapper.train()
        return out
