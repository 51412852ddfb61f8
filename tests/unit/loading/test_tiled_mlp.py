"""The tiled MLP (`Strategy.mlp_tiles`, orchestrate/loading/tiled_mlp.py) computes what the untiled MLP
does: on a 16k-token sequence a Llama whose MLPs run over even and uneven slices gives the untiled loss
and every parameter gradient (fp32, 1e-5), full fine-tuning and LoRA, through DeepSpeed's TiledMLP and
through the checkpointed slices DDP runs; a GPT-2 MLP (Conv1D, several sequences) keeps its forward's
dropout mask in backward; the rendered settings name the tiles; the memory simulation measures the tiled
model (what `orchestrate plan --simulate` reports)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from orchestrate.loading.tiled_mlp import tile_mlps
from orchestrate.planner.strategy import Strategy
from tests.helpers.plans import make_plan

WIDE_LLAMA = {"hidden_size": 64, "intermediate_size": 704, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 257}
SEQ = 16384
IMPLEMENTATIONS = {"deepspeed": True, "checkpoint": False}
"""`tile_mlps(repeated_accumulation=...)`: DeepSpeed's TiledMLP (ZeRO, FSDP2) or a checkpoint per slice (DDP)."""


def _llama(method: str, seq: int = SEQ, targets: str | list[str] = "all-linear"):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(**WIDE_LLAMA, max_position_embeddings=seq)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    if method == "lora":
        from peft import LoraConfig, get_peft_model

        # Random B (peft's default is zero): the A matrices get gradients too.
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=targets, init_lora_weights=False))
    return model


def _loss_and_grads(model, seq: int = SEQ) -> tuple[float, dict[str, torch.Tensor], int]:
    """Loss, every trained parameter's gradient and how many times the MLPs' down projections were called
    (a pre-hook: a checkpoint's recompute stops inside the last call, before a forward hook would run)."""
    ids = torch.randint(0, WIDE_LLAMA["vocab_size"], (1, seq), generator=torch.Generator().manual_seed(1))
    calls = []
    hooks = [m.register_forward_pre_hook(lambda *_: calls.append(1)) for n, m in model.named_modules()
             if n.endswith("mlp.down_proj")]
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    for hook in hooks:
        hook.remove()
    return loss.item(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}, len(calls)


@pytest.fixture(scope="module")
def untiled() -> dict[str, tuple]:
    return {method: _loss_and_grads(_llama(method)) for method in ("full", "lora")}


@pytest.mark.slow  # 16,384 tokens of attention on CPU: about a minute and a half for the four passes
@pytest.mark.parametrize(("method", "tiles", "implementation"),
                         [("full", 4, "deepspeed"), ("full", 3, "checkpoint"), ("lora", 3, "deepspeed")])
def test_tiled_mlps_give_the_untiled_loss_and_gradients(untiled, method, tiles, implementation):
    """LoRA through the checkpointed slices trains under DDP in tests/unit/loading/test_tiled_mlp_train.py (the 16k-token
    steps here are a few seconds each: attention's, not the MLP's)."""
    model = _llama(method)
    assert tile_mlps(model, tiles, repeated_accumulation=IMPLEMENTATIONS[implementation]) == 2
    loss, grads, calls = _loss_and_grads(model)
    plain_loss, plain_grads, plain_calls = untiled[method]
    assert calls == 2 * tiles * plain_calls  # every slice once in forward, once more in backward
    assert loss == pytest.approx(plain_loss, rel=1e-5)
    _assert_same_grads(grads, plain_grads)


def _assert_same_grads(grads: dict[str, torch.Tensor], plain_grads: dict[str, torch.Tensor]) -> None:
    assert grads.keys() == plain_grads.keys()
    for name, grad in grads.items():
        scale = plain_grads[name].abs().max().item()
        assert scale > 0, name
        assert (grad - plain_grads[name]).abs().max().item() <= 1e-5 * scale, name


def test_adapters_on_the_mlp_alone_and_a_short_sequence_get_their_gradients():
    """Two inputs DeepSpeed's TiledMLP alone gets wrong: below a frozen embedding the first MLP's input needs
    no grad, so its output would need none and that MLP's adapters get no gradient; 6 rows in 4 tiles are 3
    slices, and its last-slice flag that tells ZeRO the gradients are ready (`ds_grad_is_ready`) never comes."""
    seq, mlp_only = 6, ["gate_proj", "up_proj", "down_proj"]
    plain_loss, plain_grads, _ = _loss_and_grads(_llama("lora", seq, mlp_only), seq)
    model = _llama("lora", seq, mlp_only)
    tile_mlps(model, 4)
    loss, grads, _ = _loss_and_grads(model, seq)
    assert loss == pytest.approx(plain_loss, rel=1e-5)
    _assert_same_grads(grads, plain_grads)
    adapters = [p for n, p in model.named_parameters() if p.requires_grad and ".layers.1.mlp." in n]
    assert adapters and all(p.ds_grad_is_ready for p in adapters)  # layer 1's input needs grad: TiledMLP ran


@pytest.mark.parametrize("dropout", [0.0, 0.5])
def test_a_gpt2_mlp_is_tiled_over_several_sequences_with_its_forward_dropout_mask(dropout):
    """GPT-2's MLP drops out its output; its Conv1D views the input, which a slice of 2 sequences is not."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=1, n_head=4, n_positions=64, vocab_size=257,
                                       resid_pdrop=dropout)).train()
    assert tile_mlps(model, 3) == 1  # DeepSpeed's TiledMLP where it may run
    mlp = model.transformer.h[0].mlp
    params = list(mlp.parameters())

    def grads(x: torch.Tensor, out: torch.Tensor, weight: torch.Tensor) -> list[torch.Tensor]:
        for p in params:
            p.grad = None
        out.backward(weight)
        return [x.grad, *[p.grad for p in params]]

    x = torch.randn(2, 64, 64, requires_grad=True)
    weight = torch.randn(2, 64, 64)
    out = mlp(x)
    tiled = grads(x, out, weight)
    kept = (out != 0).float() / (1 - dropout)  # the forward's mask
    x_ref = x.detach().requires_grad_()
    reference = grads(x_ref, mlp.c_proj(mlp.act(mlp.c_fc(x_ref))) * kept, weight)
    for got, want in zip(tiled, reference, strict=True):
        assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()


def test_the_rendered_settings_name_the_tiles():
    from orchestrate.backends.ddp import ddp_settings
    from orchestrate.backends.fsdp import fsdp_settings

    for backend, stage, settings in (("ddp", 0, ddp_settings), ("fsdp", 3, fsdp_settings)):
        for tiles in (0, 4):
            st = settings(make_plan(replace(Strategy(backend, stage, "none", "none", "fp32", False, 2),
                                            mlp_tiles=tiles)))
            lines = [line for line in st["steps"] if "slices of the sequence" in line]
            assert st["mlp_tiles"] == tiles
            assert len(lines) == (1 if tiles else 0), (backend, tiles)
            assert not tiles or lines[0].startswith("run each block's MLP over 4 slices")


@pytest.mark.slow
def test_the_simulation_measures_the_tiled_model():
    """Untiled, each Llama MLP saves 4 intermediate-sized tensors for backward (gate, up, activation,
    product); tiled, it saves its input only, so the simulated activations stay under one per block."""
    from orchestrate.simulate import simulate_all
    from orchestrate.simulate.run_spec import spec_from_plan

    layers, seq, intermediate = 2, 512, 1408
    llama = {**WIDE_LLAMA, "model_type": "llama", "intermediate_size": intermediate, "max_position_embeddings": seq}
    specs = [spec_from_plan(make_plan(replace(Strategy(backend, stage, "none", "none", "fp32", False, 1), mlp_tiles=4),
                                      ranks=1, config={"model": {"architecture": llama},
                                                       "train": {"seq_len": seq, "global_batch_size": 1}}))
             for backend, stage in (("ddp", 0), ("fsdp", 3))]
    for spec, result in zip(specs, simulate_all(specs), strict=True):
        print(spec.strategy["backend"], result.saved_activation_bytes)
        assert 0 < result.saved_activation_bytes["activations"] < layers * seq * intermediate * 4
