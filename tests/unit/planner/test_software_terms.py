"""What each library version keeps on the GPU (planner/software_terms.py) and the adapter terms that
depend on it: versions select terms, an unknown version is a current release, bf16 adapters halve
their states."""

from __future__ import annotations

from dataclasses import replace

from orchestrate.config.schema import RunConfig
from orchestrate.hardware.profile import GPUSpec, HardwareProfile
from orchestrate.hardware.software import SoftwareStack
from orchestrate.hardware.units import GiB, MiB
from orchestrate.methods.lora.adapters import adapters_for
from orchestrate.methods.lora.memory import adapter_saved_delta
from orchestrate.methods.lora.method import adapter_terms
from orchestrate.model.formulas import shape_from_dict
from orchestrate.planner import software_terms as st
from orchestrate.planner.memory import estimate_memory
from orchestrate.planner.strategy import Strategy

LLAMA = {"model_type": "llama", "hidden_size": 512, "num_hidden_layers": 2, "num_attention_heads": 8,
         "num_key_value_heads": 8, "intermediate_size": 1376, "vocab_size": 8000, "max_position_embeddings": 2048,
         "tie_word_embeddings": False}
CURRENT = SoftwareStack()


def _hw(sw: SoftwareStack = CURRENT) -> HardwareProfile:
    gpu = GPUSpec(name="g", memory_bytes=24 * GiB, peak_tflops_fp16=70, peak_tflops_bf16=70, peak_tflops_fp32=35)
    return HardwareProfile(gpus_per_node=1, gpu=gpu, cpu_memory_bytes=64 * GiB, software=sw)


def _strategy(backend: str = "ddp", stage: int = 0, ac: bool = False) -> Strategy:
    return Strategy(backend=backend, zero_stage=stage, offload_optimizer="none", offload_params="none",
                    precision="bf16", activation_checkpointing=ac, micro_batch_size=1)


def _adapters(method: str = "lora", **lora):
    config = RunConfig.model_validate({"model": {"architecture": LLAMA}, "train": {"method": method, "lora": lora, "seq_len": 256, "global_batch_size": 2}})
    shape = shape_from_dict(LLAMA)
    return shape, adapters_for(config, shape)


def test_versions_compare_by_release_and_unknown_is_current():
    assert st.older_than("0.43.1", (0, 43, 2)) and not st.older_than("0.50.2", (0, 43, 2))
    assert st.older_than("4.16.0.dev0", (4, 41)) and not st.older_than(None, (4, 41))
    assert st.bnb_saves_4bit_input(SoftwareStack(bitsandbytes="0.43.0"))
    assert not st.bnb_saves_4bit_input(CURRENT)


def test_cuda_context_is_the_measured_eager_one_before_lazy_loading():
    assert st.cuda_context_bytes(SoftwareStack(torch="1.10.1+cu112", cuda="11.2")) == 1343 * MiB
    assert st.cuda_context_bytes(CURRENT) == st.CUDA_CONTEXT_LAZY_BYTES


def test_old_transformers_keep_more_logits_and_eager_scores():
    shape, _ = _adapters()
    old = SoftwareStack(transformers="4.31.0")
    now, then = (estimate_memory(shape, _hw(sw), _strategy(), 1024) for sw in (CURRENT, old))
    assert then.gpu["logits"] == now.gpu["logits"] * 16 / 12
    # eager Llama attention: fp32 softmax + bf16 probabilities per head and key, instead of the LSE
    extra = shape.num_layers * 1024 * shape.num_heads * (1024 * (4 + 2) - 4)
    assert then.gpu["activations"] - now.gpu["activations"] == extra


def test_torch_before_2_keeps_gradients_at_the_peak():
    shape, _ = _adapters()
    now = estimate_memory(shape, _hw(), _strategy(), 256)
    then = estimate_memory(shape, _hw(SoftwareStack(torch="1.10.1")), _strategy(), 256)
    assert then.gpu["gradients"] == 4 * shape.parameters > now.gpu["gradients"]


def test_lora_dropout_keeps_a_copy_per_adapter_and_old_bnb_keeps_the_input():
    shape, plain = _adapters()  # every block linear, dropout 0: the formula's count exactly
    assert adapter_saved_delta(shape, plain, 2, False) == 0
    _, dropped = _adapters(dropout=0.1)
    h, i = shape.hidden_size, shape.intermediate_size
    # 3 copies of the attention input, 2 of the MLP input, 1 of the down input, 1 of o_proj's, each with
    # its mask, minus the undropped inputs no frozen linear keeps
    expected = 3 * 3 * h + 2 * 3 * h + 3 * i + 3 * h - (2 * h + 2 * h + 2 * i)
    assert adapter_saved_delta(shape, dropped, 2, False) == expected
    assert adapter_saved_delta(shape, dropped, 2, True) == expected + 2 * h + 2 * h + 2 * i
    _, qv = _adapters(target_modules=["q_proj", "v_proj"])
    assert adapter_saved_delta(shape, qv, 2, False) == -(2 * h + 2 * i)  # MLP inputs no longer saved


def test_bf16_adapters_halve_their_states_under_ddp_and_fsdp():
    shape, fp32 = _adapters()
    bf16 = replace(fp32, dtype_bytes=2)
    for backend, stage in (("ddp", 0), ("fsdp", 3)):
        a = estimate_memory(shape, _hw(), _strategy(backend, stage), 256, 2, [adapter_terms(fp32, shape)]).gpu
        b = estimate_memory(shape, _hw(), _strategy(backend, stage), 256, 2, [adapter_terms(bf16, shape)]).gpu
        assert b["optimizer_states"] == a["optimizer_states"] / 2 == 4 * fp32.trainable
    _, configured = _adapters(dtype="bf16")
    assert configured.dtype_bytes == 2


def test_sdpa_is_each_familys_default_from_its_release_and_torch_2_1_1():
    for family, last_eager, first_sdpa in (("llama", "4.35.2", "4.36.0"), ("mistral", "4.36.2", "4.37.0"),
                                           ("gemma", "4.37.2", "4.38.0"), ("bert", "4.40.2", "4.41.0"),
                                           ("gpt2", "4.41.2", "4.42.0"), ("phi3", "4.44.2", "4.45.0")):
        assert st.eager_attention(SoftwareStack(transformers=last_eager), family), family
        assert not st.eager_attention(SoftwareStack(transformers=first_sdpa), family), family
    assert st.eager_attention(SoftwareStack(torch="2.1.0", transformers="4.40.2"), "llama")
    assert not st.eager_attention(SoftwareStack(torch="2.1.1", transformers="4.40.2"), "llama")
    assert not st.eager_attention(CURRENT, "llama")


def test_logits_bytes_follow_the_loss_code_of_each_release():
    assert st.logits_bytes_per_token_vocab(SoftwareStack(transformers="4.45.2")) == 16
    assert st.logits_bytes_per_token_vocab(SoftwareStack(transformers="4.46.0")) == 14
    assert st.logits_bytes_per_token_vocab(SoftwareStack(transformers="4.48.1")) == 14
    assert st.logits_bytes_per_token_vocab(SoftwareStack(transformers="4.49.0")) is None
    assert st.logits_bytes_per_token_vocab(CURRENT) is None


def test_eager_gpt2_keeps_its_attention_dropout_and_a_bf16_softmax_without_autocast():
    gpt2 = {"model_type": "gpt2", "n_embd": 256, "n_layer": 2, "n_head": 4, "vocab_size": 1000, "n_positions": 512}
    shape = shape_from_dict(gpt2)
    old = SoftwareStack(transformers="4.41.2")
    fsdp = _strategy("fsdp", 3)
    now, then = (estimate_memory(shape, _hw(sw), fsdp, 512).gpu["activations"] for sw in (CURRENT, old))
    # softmax (bf16: FSDP2 runs no autocast) + dropout mask + dropped probabilities, instead of the LSE
    assert then - now == shape.num_layers * 512 * shape.num_heads * (512 * (2 + 1 + 2) - 4)
