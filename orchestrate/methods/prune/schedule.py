"""What `prune:` means for the plan, from the config and the model shape alone: the schedule of
sparsity per step, which weights are pruned, the checks of the settings, and the size of the model a
structured run saves. Pure (no torch): the worker's pruning callback uses the same functions, so the
plan's prediction and the run agree by construction of the counts, not by a tolerance.

The mask memory is in `memory.py`; the masks themselves in `orchestrate/methods/prune/masks.py`.
"""

from __future__ import annotations

from orchestrate.config.schema import RunConfig
from orchestrate.errors import Problem, UserError
from orchestrate.methods.prune.config import PruneSection
from orchestrate.model.linears import block_linears, linear_families
from orchestrate.model.shape import ModelShape

STRUCTURED_FAMILIES = ("llama", "mistral", "qwen2", "gemma")
"""Families whose MLP is gate_proj / up_proj (rows = channels) and down_proj (columns = channels),
without biases (transformers models/llama/modeling_llama.py LlamaMLP; mistral, qwen2, gemma alike):
removing channel c removes row c of gate/up and column c of down_proj, nothing else."""

MLP_LINEARS = ("gate_proj", "up_proj", "down_proj")
HEAD_LINEARS = ("q_proj", "o_proj")
"""A query head h is rows h·d .. (h+1)·d of q_proj and those columns of o_proj; it reads key/value
head h // (heads / kv_heads) (transformers' repeat_kv), so every group loses the same number."""


def sparsity_at(step: int, prune: PruneSection) -> float:
    """s_t = s_f + (s_i - s_f)(1 - (t - t0)/(n·Δt))^3 with s_i = 0 (Zhu & Gupta 2017, eq. 1):
    0 up to t0, s_f from t0 + n·Δt on, steep at first and flat at the end (the model recovers)."""
    sch = prune.schedule
    if step <= sch.start_step:
        return 0.0
    done = min(1.0, (step - sch.start_step) / (sch.end_step - sch.start_step))
    return prune.target_sparsity * (1.0 - (1.0 - done) ** 3)


def updates_mask(step: int, prune: PruneSection) -> bool:
    """Whether the masks are recomputed after `step`: every Δt steps after t0, and at end_step
    (so the target is reached even when Δt does not divide the schedule)."""
    sch = prune.schedule
    return sch.start_step < step <= sch.end_step and ((step - sch.start_step) % sch.every == 0
                                                      or step == sch.end_step)


def scheduled_sparsity(step: int, prune: PruneSection) -> float:
    """The sparsity the masks have after `step`: s_t of the last mask update at or before it."""
    sch = prune.schedule
    if step >= sch.end_step:
        return prune.target_sparsity
    last = sch.start_step + (step - sch.start_step) // sch.every * sch.every
    return sparsity_at(last, prune) if step > sch.start_step else 0.0


def pruned_count(sparsity: float, total: int) -> int:
    """How many of `total` weights (or channels) sparsity prunes: rounded down, never all."""
    return min(total - 1, int(sparsity * total))


def prunable_linears(shape: ModelShape, prune: PruneSection) -> list[tuple[str, int, int]]:
    """(name, d_in, d_out) of the block linears whose weights are pruned: every block linear
    (magnitude; embeddings and the head stay dense, as in Zhu & Gupta's LM experiments), or the MLP's."""
    linears = block_linears(shape) or []
    structured = MLP_LINEARS + (HEAD_LINEARS if prune.heads else ())
    return [x for x in linears if prune.method == "magnitude" or x[0] in structured]


def pruned_channels(shape: ModelShape, prune: PruneSection) -> int:
    """MLP channels a structured run removes from every block (0 for magnitude pruning)."""
    return pruned_count(prune.target_sparsity, shape.intermediate_size) if prune.method == "structured" else 0


def pruned_heads(shape: ModelShape, prune: PruneSection) -> int:
    """Query heads a structured run with `heads` removes from every key/value group of every block."""
    group = shape.num_heads // shape.num_kv_heads
    return pruned_count(prune.target_sparsity, group) if prune.method == "structured" and prune.heads else 0


def _q_bias(shape: ModelShape) -> bool:
    """Whether q_proj has a bias (qwen2; llama with attention_bias): the block holds more than its
    linears' weights and its two norms (modeling_llama.py LlamaDecoderLayer)."""
    weights = sum(i * o for _, i, o in block_linears(shape) or [])
    return shape.block_parameters > weights + 2 * shape.hidden_size


def pruned_parameters(shape: ModelShape, prune: PruneSection) -> int:
    """Parameters of the saved model: a structured run removes h weights from each of gate, up and
    down_proj per channel, and 2·h·d (+ d of q_proj's bias) per query head, in every block;
    magnitude pruning keeps the shape (zeros are still parameters)."""
    h, d = shape.hidden_size, shape.head_dim
    heads = pruned_heads(shape, prune) * shape.num_kv_heads
    per_block = 3 * h * pruned_channels(shape, prune) + heads * (2 * h * d + (d if _q_bias(shape) else 0))
    return shape.parameters - shape.num_layers * per_block


def _problems(config: RunConfig, shape: ModelShape) -> list[Problem]:
    prune, out = config.prune, []
    if config.train.max_steps is not None and prune.schedule.end_step > config.train.max_steps:  # num_epochs: unknown here
        out.append(Problem("prune.schedule.end_step", f"{prune.schedule.end_step} is after train.max_steps "
                           f"({config.train.max_steps}): the target sparsity would never be reached",
                           f"use end_step <= {config.train.max_steps}, or raise train.max_steps"))
    if config.train.method != "full":
        out.append(Problem("train.method", f"{config.train.method} freezes the weights pruning would zero",
                           "use method: full with prune, or remove prune"))
    if block_linears(shape) is None:
        out.append(Problem("prune", f"pruning knows the block linears of the {', '.join(linear_families())} "
                           f"families, not {shape.model_type}", "use a model of those families, or remove prune"))
    elif prune.method == "structured" and shape.model_type not in STRUCTURED_FAMILIES:
        out.append(Problem("prune.method", f"structured pruning removes MLP channels of gate/up/down_proj "
                           f"({', '.join(STRUCTURED_FAMILIES)}); it cannot prune a {shape.model_type} MLP",
                           "use method: magnitude for this model"))
    if prune.heads and prune.method != "structured":
        out.append(Problem("prune.heads", "removing heads is structured pruning", "set method: structured"))
    elif prune.heads and shape.num_heads == shape.num_kv_heads:
        out.append(Problem("prune.heads", "every query head has its own key/value head here (no grouped-query "
                           "attention): removing one would need its k/v_proj rows too, which is not built",
                           "set heads: false"))
    if prune.method == "structured" and prune.scope == "global":
        out.append(Problem("prune.scope", "structured pruning gives every block the same intermediate_size "
                           "(config.json holds one), so one global threshold cannot apply", "use scope: per-layer"))
    return out


def check_prune(config: RunConfig, shape: ModelShape) -> None:
    """UserError listing every problem of the `prune:` settings for this model (nothing when unset)."""
    if config.prune is not None and (problems := _problems(config, shape)):
        raise UserError("Cannot plan this run: the pruning settings do not fit", problems)


def prune_summary(shape: ModelShape, prune: PruneSection) -> dict:
    """What `orchestrate plan` (and --json's "prune") says the run will save."""
    channels = pruned_channels(shape, prune)
    return {"method": prune.method, "target_sparsity": prune.target_sparsity, "scope": prune.scope,
            "pruned_weights": shape.num_layers * sum(i * o for _, i, o in prunable_linears(shape, prune)),
            "saved_parameters": pruned_parameters(shape, prune),
            "saved_intermediate_size": shape.intermediate_size - channels,
            "saved_num_attention_heads": shape.num_heads - pruned_heads(shape, prune) * shape.num_kv_heads}
