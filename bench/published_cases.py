"""The published GPU memory measurements bench/published_peaks.py re-plans: each source, the stack it ran
(library versions as stated or as its code at the commit pins them), every stated setting, the metric,
what could not be pinned and why the prediction lands where it does. Cases a plan cannot reproduce are
kept with the reason (`left_out`) and not counted.

Kept out on purpose (an independent check for later): Lightning litgpt's config_hub tables and
torchtune's README memory table (torchtune's own PR tables too, for the same reason).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from orchestrate.hardware.profile import GPUSpec
from orchestrate.hardware.software import SoftwareStack
from orchestrate.hardware.units import GiB, MiB
from orchestrate.planner.strategy import Strategy

ALLOCATED, RESERVED, SMI = "max_memory_allocated", "max_memory_reserved", "nvidia-smi"


@dataclass(frozen=True)
class Case:
    name: str
    source: str
    metric: str
    """max_memory_allocated | max_memory_reserved | nvidia-smi"""
    published_bytes: float
    gpu: GPUSpec
    gpus: int
    software: SoftwareStack
    architecture: dict
    train: dict
    """RunConfig.train: method, seq_len, global_batch_size, lora, optimizer ..."""
    strategy: Strategy
    accumulation: int = 1
    task: str = "causal-lm"
    num_labels: int | None = None
    unpinned: str = ""
    """What the source does not state or orchestrate cannot pin."""
    residual: str = ""
    """Why predicted / published is what it is, in one line."""
    left_out: str = ""
    """Set: the case is listed, not counted (its settings cannot be reproduced by a plan)."""
    settings: dict = field(default_factory=dict)
    """Every stated setting, as the source states it (printed with --json)."""
    fsdp1: bool = False
    """The run used FSDP1 (flat parameters, its own streams and allocations), planned as orchestrate's FSDP2;
    sharded, its prediction carries FSDP1_OVER_FSDP2."""

    @property
    def sharded_fsdp1(self) -> bool:
        """FSDP1 with sharded parameters (NO_SHARD is planned as DDP, which it is but for the flat buffers)."""
        return self.fsdp1 and self.strategy.backend == "fsdp"


def _s(backend: str, stage: int, precision: str, ac: bool, mb: int, optimizer: str = "adamw",
       offload: str = "none") -> Strategy:
    return Strategy(backend=backend, zero_stage=stage, offload_optimizer=offload, offload_params=offload,
                    precision=precision, activation_checkpointing=ac, micro_batch_size=mb, optimizer=optimizer)


def _gpu(name: str, gib: float, cc: tuple[int, int], fp16: float, bf16: float, fp32: float) -> GPUSpec:
    return GPUSpec(name=name, memory_bytes=int(gib * GiB), compute_capability=cc, peak_tflops_fp16=fp16,
                   peak_tflops_bf16=bf16, peak_tflops_fp32=fp32)


V100 = _gpu("Tesla V100-SXM2-16GB", 16160 / 1024, (7, 0), 125, 0, 15.7)
RTX3090 = _gpu("NVIDIA GeForce RTX 3090", 24, (8, 6), 71, 71, 35.6)
A10G = _gpu("NVIDIA A10G", 24, (8, 6), 125, 125, 31.2)
A100_40 = _gpu("NVIDIA A100-SXM4-40GB", 40, (8, 0), 312, 312, 19.5)
A100_80 = _gpu("NVIDIA A100-SXM4-80GB", 80, (8, 0), 312, 312, 19.5)
A100_80_NVLINK = A100_80.model_copy(update={"nvlink": True})
"""fms-acceleration's A100-SXM4-80GB nodes: SXM4 boards join their GPUs by NVLink (NCCL's channel count)."""
H100_95 = _gpu("NVIDIA H100 (95.04 GiB)", 95.0396, (9, 0), 989, 989, 67)

# --- model configs (config.json of each checkpoint) ---------------------------------------------------

BERT_LARGE = {"model_type": "bert", "hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16,
              "intermediate_size": 4096, "vocab_size": 30522, "max_position_embeddings": 512,
              "type_vocab_size": 2, "hidden_act": "gelu", "hidden_dropout_prob": 0.1,
              "attention_probs_dropout_prob": 0.1}
_LLAMA = {"model_type": "llama", "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
LLAMA2_7B = {**_LLAMA, "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 32, "intermediate_size": 11008, "vocab_size": 32000, "max_position_embeddings": 4096}
LLAMA2_70B = {**_LLAMA, "hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64,
              "num_key_value_heads": 8, "intermediate_size": 28672, "vocab_size": 32000, "max_position_embeddings": 4096}
YI_34B = {**_LLAMA, "hidden_size": 7168, "num_hidden_layers": 60, "num_attention_heads": 56, "num_key_value_heads": 8,
          "intermediate_size": 20480, "vocab_size": 64000, "max_position_embeddings": 4096}
LLAMA3_70B = {**_LLAMA, "hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64,
              "num_key_value_heads": 8, "intermediate_size": 28672, "vocab_size": 128256, "max_position_embeddings": 8192}
MISTRAL_7B = {"model_type": "mistral", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
              "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 32000, "rms_norm_eps": 1e-5,
              "max_position_embeddings": 32768, "sliding_window": 4096, "tie_word_embeddings": False}

# --- 1. transformers docs: bert-large on a V100 ------------------------------------------------------------

HF_DOCS = ("transformers docs, Efficient Training on a Single GPU (perf_train_gpu_one.mdx, v4.16-4.21 era): "
           "huggingface/transformers@0016acf7ef421c7fe8eff7945de52c71896c3b01:docs/source/en/perf_train_gpu_one.mdx")
# nvidia-smi shows CUDA 11.2, driver 460.91; docs of January 2022 = transformers 4.16, whose Trainer ran
# torch 1.10 (not stated: the torch version; the driver's CUDA 11.2 is what the context was measured on).
HF_DOCS_STACK = SoftwareStack(torch="1.10.1+cu112", cuda="11.2", transformers="4.16.0")
_BERT_RESIDUAL = ("eager attention (s x s softmax, dropout mask and output per head), torch 1.10's zero_grad keeping "
                  "every .grad and the measured 1,343 MiB context are counted; the replay-fitted DDP reserve without "
                  "expandable segments (282 MiB + 1 % of the states + 31 % of the transient bytes) is 20-24 % of "
                  "allocated on the bs4 rows, where activations dominate, and 7-13 % on the bs1 and checkpointed "
                  "ones (0.96-1.08)")


def _bert(name: str, mib: int, precision: str, mb: int, ga: int, gc: bool, optimizer: str) -> Case:
    return Case(
        name=name, source=HF_DOCS, metric=SMI, published_bytes=mib * MiB, gpu=V100, gpus=1,
        software=HF_DOCS_STACK, architecture=BERT_LARGE, task="sequence-classification", num_labels=2,
        train={"method": "full", "seq_len": 512, "global_batch_size": mb * ga, "optimizer": {"name": optimizer}},
        strategy=_s("ddp", 0, precision, gc, mb, optimizer), accumulation=ga,
        settings={"model": "bert-large-uncased (AutoModelForSequenceClassification)", "seq_len": 512,
                  "per_device_train_batch_size": mb, "gradient_accumulation_steps": ga,
                  "gradient_checkpointing": gc, "precision": "fp16 (Trainer, amp)" if precision == "fp16" else "fp32",
                  "optimizer": "bnb.optim.Adam8bit" if optimizer == "adamw8bit" else "Trainer default AdamW",
                  "gpus": "1 x V100 16 GB", "driver/CUDA": "460.91.03 / 11.2",
                  "metric": "pynvml used memory after trainer.train() (MiB)"},
        unpinned=("torch and transformers versions (docs of January 2022: transformers 4.16, torch 1.10 assumed); "
                  "the Trainer's own AdamW (per-parameter, not fused)"),
        residual=_BERT_RESIDUAL)


CASES = [
    _bert("bert-large bs4 fp32", 14949, "fp32", 4, 1, False, "adamw"),
    _bert("bert-large bs1 ga4 fp32", 8681, "fp32", 1, 4, False, "adamw"),
    _bert("bert-large bs1 ga4 gc fp32", 6775, "fp32", 1, 4, True, "adamw"),
    _bert("bert-large bs4 fp16", 13939, "fp16", 4, 1, False, "adamw"),
    _bert("bert-large bs1 ga4 gc fp16", 7275, "fp16", 1, 4, True, "adamw"),
    _bert("bert-large bs4 fp32 adam8bit", 13085, "fp32", 4, 1, False, "adamw8bit"),
    _bert("bert-large bs1 ga4 gc fp16 adam8bit", 5363, "fp16", 1, 4, True, "adamw8bit"),
]

# --- 2. Answer.AI fsdp_qlora on 2 x RTX 3090 ---------------------------------------------------------------

ANSWER_AI = ("Answer.AI fsdp_qlora, Benchmarking QLoRA+FSDP (Feb-Mar 2024): "
             "AnswerDotAI/fsdp_qlora@05ed9f2:benchmarks_03_2024.md, settings in train.py@50efa1e")
# README of the time: torch >= 2.2, bitsandbytes >= 0.43.0 (the first with quant_storage; 0.43.2, which
# stopped saving the 4-bit input, came in July 2024), transformers != 4.38/4.39 (4.37 was current).
ANSWER_AI_STACK = SoftwareStack(torch="2.2.1+cu121", cuda="12.1", transformers="4.37.2", peft="0.9.0",
                                bitsandbytes="0.43.0")
_AA_RESERVED = ("the replay-fitted FSDP2 reserve without expandable segments (284 MiB + 1 % of the states + 26.5 % "
                "of the transient bytes: 9-25 % of allocated here) times FSDP1's measured excess over FSDP2 (x1.036, "
                "torchtitan PR #165): 0.96-1.13 from seq 2048 on; at seq 512, micro-batch 1 (LoRA 0.94, QLoRA 0.87) "
                "the published reserved peak is about the one of seq 2048 (10.24 vs 10.22 GiB, 4.98 vs 5.21 GiB) "
                "while LoRA's allocated fell 0.9 GiB: that peak is not set by the training step. Likely the cache "
                "of FSDP1's wrapping: the source states 3.72 GiB reserved right after wrapping the QLoRA model "
                "(our sharded weights: 1.93 GiB) and train.py resets the peaks without emptying the cache; not "
                "traced further; train.py keeps `output` (fp32 logits) through backward")
_AA_ALLOCATED = ("allocated, like with like: bf16 adapters, 3 dropout copies per attention input (r 64, p 0.1), "
                 "transformers 4.37's fp32 logits held by train.py through backward, bnb 0.43.0's saved input, "
                 "FSDP1's measured excess over FSDP2 (x1.037, torchtitan PR #165)")
_AA_OFFLOAD = ("FSDP1 CPUOffload(offload_params=True), planned as FSDP2's CPUOffloadPolicy (x FSDP1's measured "
               "excess), nearly all of it transient (gathered blocks, activations: a 28 % reserve): 0.93-1.14 in "
               "Answer.AI's rows (0.2-1.0 GiB below the 7B LoRA, 34B and 70B ones), 4.5 GiB below the PEFT docs' "
               "70B nvidia-smi row (0.77). Likely, not verified: FSDP1's init moves "
               "each unit to the GPU to flatten and shard it, then the shard to the CPU (torch/distributed/fsdp/"
               "_init_utils.py `_move_module_to_device`, `_init_param_handle_from_params`), and train.py resets "
               "the peaks after wrapping without emptying the cache, so that cache counts as reserved")


def _answer_ai(name: str, gib: float, method: str, bs: int, sharding: str = "full_shard", metric: str = RESERVED,
               ctx: int = 2048, arch: dict = LLAMA2_7B, model: str = "meta-llama/Llama-2-7b-hf",
               offload: bool = False, residual: str = "") -> Case:
    residual = residual or (_AA_OFFLOAD if offload else _AA_ALLOCATED if metric == ALLOCATED else _AA_RESERVED)
    lora = {"r": 64, "alpha": 16, "dropout": 0.1, "dtype": "bf16",
            "target_modules": ["k_proj", "q_proj", "v_proj", "up_proj", "down_proj", "gate_proj"]}
    backend, stage = ("ddp", 0) if sharding == "ddp" else ("fsdp", 3)
    return Case(
        name=name, source=ANSWER_AI, metric=metric, published_bytes=gib * GiB, gpu=RTX3090, gpus=2,
        software=ANSWER_AI_STACK, architecture=arch, fsdp1=True,
        train={"method": method, "seq_len": ctx, "global_batch_size": 2 * bs, "lora": lora},
        strategy=_s(backend, stage, "bf16", True, bs, offload="cpu" if offload else "none"),
        settings={"model": model, "train_type": method, "context_length": ctx, "batch_size": bs,
                  "sharding_strategy": "ddp (FSDP NO_SHARD)" if sharding == "ddp" else "full_shard (FSDP1)",
                  "precision": "bf16 (whole model cast, adapters too; no FSDP mixed precision)",
                  "use_gradient_checkpointing": True, "reentrant_checkpointing": True, "use_cpu_offload": offload,
                  "lora": "r 64, alpha 16, dropout 0.1, q/k/v/gate/up/down", "optimizer": "torch AdamW",
                  "attn_implementation": "sdpa", "gpus": "2 x RTX 3090 24 GB, no NVLink",
                  "metric": "torch.cuda.max_memory_reserved over the first epoch (GiB)"},
        unpinned=("exact transformers/peft/bitsandbytes/torch versions (README of the time: torch >= 2.2, "
                  "bitsandbytes >= 0.43.0, transformers != 4.38/4.39); FSDP1 (flat parameters, limit_all_gathers) "
                  "planned as FSDP2 full shard; dummy data: every sample context_length tokens"),
        residual=residual)


CASES += [
    _answer_ai("llama2-7b qlora fsdp bs1 512", 4.98, "qlora", 1, ctx=512),
    _answer_ai("llama2-7b qlora fsdp bs1 2048", 5.21, "qlora", 1),
    _answer_ai("llama2-7b lora fsdp bs1 512", 10.24, "lora", 1, ctx=512),
    _answer_ai("llama2-7b lora fsdp bs1 2048", 10.22, "lora", 1),
    _answer_ai("llama2-7b lora fsdp bs1 512 (alloc)", 8.28, "lora", 1, metric=ALLOCATED, ctx=512),
    _answer_ai("llama2-7b lora fsdp bs1 2048 (alloc)", 9.16, "lora", 1, metric=ALLOCATED),
    _answer_ai("llama2-7b qlora fsdp bs4 2048", 11.22, "qlora", 4),
    _answer_ai("llama2-7b qlora fsdp bs10 2048", 20.97, "qlora", 10),
    _answer_ai("llama2-7b lora fsdp bs4 2048", 16.14, "lora", 4),
    _answer_ai("llama2-7b lora fsdp bs6 2048", 21.35, "lora", 6),
    _answer_ai("llama2-7b qlora no_shard bs8 2048", 20.94, "qlora", 8, sharding="ddp"),
    _answer_ai("llama2-7b lora no_shard bs4 2048", 22.04, "lora", 4, sharding="ddp"),
    _answer_ai("llama2-7b lora fsdp offload bs10", 22.69, "lora", 10, offload=True),
    _answer_ai("llama2-7b qlora fsdp offload bs12", 22.38, "qlora", 12, offload=True),
    _answer_ai("yi-34b qlora fsdp bs2 2048", 23.05, "qlora", 2, arch=YI_34B, model="01-ai/Yi-34B"),
    _answer_ai("yi-34b qlora fsdp offload bs4", 22.98, "qlora", 4, arch=YI_34B, model="01-ai/Yi-34B", offload=True),
    _answer_ai("llama2-70b qlora fsdp offload bs2", 14.92, "qlora", 2, arch=LLAMA2_70B,
               model="meta-llama/Llama-2-70b-hf", offload=True),
]

# --- 3. fms-acceleration's reference benchmarks on A100-80GB -------------------------------------------------

FMS = ("IBM fms-acceleration reference benchmarks (A100-80GB): foundation-model-stack/fms-acceleration@24bdadb:"
       "scripts/benchmarks/refs/a100_80gb.csv, settings in scenarios.yaml, defaults.yaml, accelerate.yaml and "
       "benchmark.py (packing True, max_seq_len 4096), versions in refs/requirements.txt")
FMS_STACK = SoftwareStack(torch="2.4.1+cu121", cuda="12.1", transformers="4.48.1", peft="0.13.2",
                          bitsandbytes="0.43.3")
_FMS_SETTINGS = {"model": "mistralai/Mistral-7B-v0.1", "torch_dtype": "bfloat16", "packing": True,
                 "max_seq_length": 4096, "gradient_checkpointing": "True (HF, reentrant)", "use_flash_attn": True,
                 "optimizer": "Trainer default adamw_torch", "max_steps": 100,
                 "lora": "r 16, alpha 16, dropout 0.1, q/k/v/o", "gpus": "A100-SXM4-80GB",
                 "2 GPUs": "accelerate FSDP1 FULL_SHARD, TRANSFORMER_BASED_WRAP, BACKWARD_PRE, mixed_precision no",
                 "metrics": "peak: HF Trainer memory metrics (max_memory_allocated, rank 0); nvidia-smi memory.used "
                            "peak averaged over the GPUs (MiB)"}
_FMS_LOADED = ("allocated: the 16-bit logits, their fp32 up-cast, transformers 4.48's shifted fp32 copy and the "
               "log-softmax at the end of forward (14 B per token and vocabulary entry) are counted")
_FMS_FSDP = ("FSDP1's measured excess over FSDP2 (x1.037 active, torchtitan PR #165) counted; its peak still grows "
             "faster per token than the one-GPU runs of this source (0.74-0.78 vs 0.68 MiB/token), not traced in "
             "its code here")
_FMS_SMI = ("nvidia-smi on an 80 GB card (NVLink: NCCL's 24 channels, 992 MiB): the allocator held 12-14 % above "
            "allocated on one GPU and 16-26 % under FSDP1, more where activations are more of the peak; the "
            "replay-fitted reserves without expandable segments (DDP 282 MiB + 1 % of the states + 31 % of the "
            "transient bytes, FSDP2 284 MiB + 1 % + 26.5 %, x1.036 for FSDP1) plan 16-21 % and 15-25 %: "
            "0.97-1.06")


def _fms(name: str, method: str, gpus: int, bs: int, metric: str, published: float, residual: str) -> Case:
    lora = {"r": 16, "alpha": 16, "dropout": 0.1, "dtype": "fp32",
            "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
    backend, stage = ("ddp", 0) if gpus == 1 else ("fsdp", 3)
    return Case(
        name=name, source=FMS, metric=metric, published_bytes=published, gpu=A100_80_NVLINK, gpus=gpus, software=FMS_STACK,
        fsdp1=gpus > 1,
        architecture=MISTRAL_7B, train={"method": method, "seq_len": 4096, "global_batch_size": gpus * bs,
                                        **({"lora": lora} if method != "full" else {})},
        strategy=_s(backend, stage, "bf16", True, bs),
        settings={**_FMS_SETTINGS, "per_device_train_batch_size": bs, "num_gpus": gpus,
                  "framework_config": "none (transformers + peft)" if method == "lora" else
                  "baseline-peft-bnb (nf4, double quant, quant_storage bf16 under FSDP, bf16 True)"},
        unpinned=("FSDP1 planned as FSDP2; the adapters' fp32 inputs without autocast (peft casts x to the adapter "
                  "dtype) counted at the compute dtype (they matter only in the recomputed block, below the logits)"),
        residual=residual)


CASES += [
    _fms("mistral-7b lora bs4 (alloc)", "lora", 1, 4, ALLOCATED, 26704571904, _FMS_LOADED),
    _fms("mistral-7b lora bs8 (alloc)", "lora", 1, 8, ALLOCATED, 38742912512, _FMS_LOADED),
    _fms("mistral-7b lora fsdp bs2 (alloc)", "lora", 2, 2, ALLOCATED, 15144870400, _FMS_FSDP),
    _fms("mistral-7b lora fsdp bs4 (alloc)", "lora", 2, 4, ALLOCATED, 21959827968, _FMS_FSDP),
    _fms("mistral-7b qlora fsdp bs2 (alloc)", "qlora", 2, 2, ALLOCATED, 9424594432, _FMS_FSDP),
    _fms("mistral-7b qlora fsdp bs4 (alloc)", "qlora", 2, 4, ALLOCATED, 15970067968, _FMS_FSDP),
    _fms("mistral-7b lora bs4 (smi)", "lora", 1, 4, SMI, 29576 * MiB, _FMS_SMI),
    _fms("mistral-7b lora bs8 (smi)", "lora", 1, 8, SMI, 43232 * MiB, _FMS_SMI),
    _fms("mistral-7b lora fsdp bs2 (smi)", "lora", 2, 2, SMI, 18678 * MiB, _FMS_SMI),
    _fms("mistral-7b lora fsdp bs4 (smi)", "lora", 2, 4, SMI, 26328 * MiB, _FMS_SMI),
    _fms("mistral-7b qlora fsdp bs2 (smi)", "qlora", 2, 2, SMI, 13164 * MiB, _FMS_SMI),
    _fms("mistral-7b qlora fsdp bs4 (smi)", "qlora", 2, 4, SMI, 21182 * MiB, _FMS_SMI),
]
_FMS_FP32_STREAM = ("one-GPU QLoRA through TRL 0.13: prepare_model_for_kbit_training and peft_module_casting_to_bf16 "
                    "keep the norms fp32 and bitsandbytes' Linear4bit returns its input's dtype, so the residual stream "
                    "and every checkpointed block input run in fp32 (the 256 KiB/token measured above the LoRA rows); "
                    "orchestrate's engines keep them in the compute dtype")
for _bs, _peak in ((4, 20669338112), (8, 37002646016)):
    CASES.append(Case(**{**_fms(f"mistral-7b qlora bs{_bs} (alloc)", "qlora", 1, _bs, ALLOCATED, _peak, "").__dict__,
                         "left_out": _FMS_FP32_STREAM}))
CASES.append(Case(**{**_fms("mistral-7b full bf16 bs4 (alloc)", "full", 1, 4, ALLOCATED, 72434837504, "").__dict__,
                     "left_out": "pure bf16 weights and bf16 AdamW states (torch_dtype bfloat16, no mixed precision): "
                                 "orchestrate trains full models with fp32 master weights and states"}))

# --- 4. PEFT docs (pacman100): Llama-2-70B QLoRA on two GPUs -----------------------------------------------

PEFT_DOCS = ("PEFT docs, FSDP and DeepSpeed guides (QLoRA sections, Mar 2024): huggingface/peft@6008f272a:"
             "docs/source/accelerate/fsdp.md and deepspeed.md, settings in examples/sft/run_peft_qlora_fsdp.sh, "
             "run_peft_qlora_deepspeed_stage3.sh and configs/")
# "bitsandbytes>=0.43.0, accelerate>=0.28.0, transformers>4.38.2, trl>0.7.11 and peft>0.9.0" at a commit of
# 13 March 2024 (transformers 4.39.0 came on the 21st: a main-branch build); torch not stated.
PEFT_DOCS_STACK = SoftwareStack(torch="2.2.1+cu121", cuda="12.1", transformers="4.39.0.dev0", peft="0.10.0.dev0",
                                bitsandbytes="0.43.0")


def _peft_docs(name: str, gb: float, backend: str, offload: bool, gpu: GPUSpec, where: str, residual: str) -> Case:
    stage = 3
    return Case(
        name=name, source=PEFT_DOCS, metric=SMI, published_bytes=gb * GiB, gpu=gpu, gpus=2, software=PEFT_DOCS_STACK,
        architecture=LLAMA2_70B, accumulation=2, fsdp1=backend == "fsdp",
        train={"method": "qlora", "seq_len": 2048, "global_batch_size": 8,
               "lora": {"r": 8, "alpha": 16, "dropout": 0.1, "dtype": "bf16", "target_modules": "auto"}},
        strategy=_s(backend, stage, "bf16", True, 2, offload="cpu" if offload else "none"),
        settings={"model": "meta-llama/Llama-2-70b-hf", "max_seq_len": 2048, "packing": True,
                  "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2, "gradient_checkpointing": True,
                  "use_reentrant": True, "use_flash_attn": True, "bf16": True,
                  "lora": "r 8, alpha 16, dropout 0.1, all-linear", "quantization": "nf4, nested, quant_storage bf16",
                  "strategy": where, "gpus": f"2 x {gpu.name}", "metric": "'memory consumed per GPU' (GB)"},
        unpinned=("the metric (the script logs no torch memory statistics: nvidia-smi assumed) and GB vs GiB (GiB "
                  "taken, the stricter); the torch version; FSDP1 planned as FSDP2; the GPU of the no-offload run"),
        residual=residual)


CASES += [
    _peft_docs("llama2-70b qlora fsdp offload", 19.6, "fsdp", True, RTX3090,
               "accelerate FSDP1 FULL_SHARD, offload_params, use_orig_params false, cpu_ram_efficient_loading",
               _AA_OFFLOAD + "; the only row below 0.95 on a card more than 80 % full, and the source's own caveat "
               "3 says 'GPU Memory saving when using CPU Offloading is untested at present'"),
    _peft_docs("llama2-70b qlora fsdp", 35.6, "fsdp", False, A100_80,
               "accelerate FSDP1 FULL_SHARD, no offload", "2.3 GiB below: FSDP1 on an 80 GB card held more than "
               "the replay-fitted FSDP2 reserve (284 MiB + 1 % of the states + 26.5 % of the transient bytes, "
               "x1.036 for FSDP1: 11 % here, a 4-bit base's states dominate) predicts as needed; not traced (no "
               "allocated peak published to split it)"),
    _peft_docs("llama2-70b qlora zero3", 36.6, "deepspeed", False, A100_40,
               "accelerate DeepSpeed ZeRO-3, zero3_init, no offload, mixed_precision bf16",
               "DeepSpeed ZeRO-3 with a 4-bit base: not traced; the replay-fitted ZeRO reserve without expandable "
               "segments (994 MiB + 6.5 % of the states + 27 % of the transient bytes: 17 % here)"),
]

# --- 5. torchtitan PR #165 (awgu): FSDP1 -> FSDP2 at equal settings on 8 x H100 ------------------------------

TORCHTITAN = ("torchtitan PR #165 (awgu, Used per-parameter FSDP, Mar 2024): https://github.com/pytorch/torchtitan/"
              "pull/165, settings in pytorch/torchtitan@83c879f:train.py, train_configs/llama_7b.toml, "
              "torchtrain/parallelisms/parallelize_llama.py, torchtrain/models/llama/model.py")
# A torch nightly of March 2024 (FSDP2 was in main only). No transformers: torchtitan's own Llama; its logits
# follow the pattern of transformers before 4.46 (model.py `self.output(h).float()`, train.py keeps `pred`
# through backward beside cross_entropy's fp32 log-softmax), so that release pins the logits term.
TORCHTITAN_STACK = SoftwareStack(torch="2.4.0.dev20240326+cu121", cuda="12.1", transformers="4.45.2")
TORCHTITAN_PCT = {("FSDP2", ALLOCATED): 23.92, ("FSDP2", RESERVED): 32.64,
                  ("FSDP1", ALLOCATED): 24.81, ("FSDP1", RESERVED): 33.82}
"""Full activation checkpointing (AC) rows of the PR text, in % of 95.0396 GiB; its selective-AC rows
(FSDP1 52.98 / 67.23, FSDP2 52.13 / 62.51) have no orchestrate knob."""
FSDP1_OVER_FSDP2 = {metric: TORCHTITAN_PCT["FSDP1", metric] / TORCHTITAN_PCT["FSDP2", metric]
                    for metric in (ALLOCATED, RESERVED)}
"""FSDP1's peak over FSDP2's in the same run, measured by FSDP2's author (torchtitan PR #165: Llama-7B, 8 x
H100, full AC, bf16 params, fp32 reduce-scatter): 1.037 active, 1.036 reserved. Applied to the published
FSDP1 runs (all with per-block checkpointing), which orchestrate plans as its FSDP2: like with like, the
run's engine as measured, not a fit to those rows. (torchtitan docs/fsdp.md: "7% lower peak memory" is
the selective-AC reserved pair, 67.23 / 62.51.)"""
_TT_SETTINGS = {"model": "torchtitan llama 7B (dim 4096, 32 layers, 32 heads, SwiGLU 11008, Llama-2 tokenizer "
                         "32000, untied output)", "batch_size": 8, "seq_len": 2048, "dataset": "minipile",
                "activation_checkpoint": "full (per-block checkpoint_wrapper, preserve_rng_state False)",
                "mixed precision": "param bf16, reduce fp32", "optimizer": "AdamW foreach (lr 3e-4, wd 0.1)",
                "gpus": "8 x H100 (95.0396 GiB)", "metric": "active_bytes.all.peak / reserved_bytes.all.peak",
                "steps": 1000}
_TT_ALLOCATED = ("FSDP2, orchestrate's engine: fp32 sharded weights and AdamW states, the root unsharded, two "
                 "blocks gathered, 32 checkpointed block inputs and the fp32 logits held through backward; "
                 "'peak active' also counts blocks freed but awaiting another stream, so it sits at or above "
                 "allocated")
_TT_RESERVED = ("on a card with room (31 of 95 GiB) FSDP2's allocator held 36 % above active; our replay of "
                "16-block FSDP2 points with room holds 31-49 %, but the planner's reserve is the need (the least "
                "memory the replay runs in: 284 MiB + 1 % of the states + 26.5 % of the transient bytes, 17 % "
                "here), which a reserved peak with room does not measure")


def _torchtitan(engine: str, metric: str, residual: str = "", left_out: str = "") -> Case:
    return Case(
        name=f"llama-7b full {engine.lower()} 8xH100 ({'active' if metric == ALLOCATED else 'reserved'})",
        source=TORCHTITAN, metric=metric, published_bytes=TORCHTITAN_PCT[engine, metric] / 100 * 95.0396 * GiB,
        gpu=H100_95, gpus=8, software=TORCHTITAN_STACK, architecture=LLAMA2_7B, fsdp1=engine == "FSDP1",
        train={"method": "full", "seq_len": 2048, "global_batch_size": 64}, strategy=_s("fsdp", 3, "bf16", True, 8),
        settings={**_TT_SETTINGS, "engine": engine + (" FULL_SHARD, BACKWARD_PRE, use_orig_params, limit_all_gathers"
                                                       if engine == "FSDP1" else
                                                       " fully_shard per block, last block not resharded")},
        unpinned=("the torch nightly; torchtitan's foreach AdamW (its step temporary stays below the backward peak) "
                  "planned as fused; the last block kept unsharded after forward (one block, 0.38 GiB)"),
        residual=residual, left_out=left_out)


_TT_FACTOR = "the source of FSDP1_OVER_FSDP2: counted, it would repeat the FSDP2 row's ratio"
CASES += [
    _torchtitan("FSDP2", ALLOCATED, _TT_ALLOCATED),
    _torchtitan("FSDP2", RESERVED, _TT_RESERVED),
    _torchtitan("FSDP1", ALLOCATED, left_out=_TT_FACTOR),
    _torchtitan("FSDP1", RESERVED, left_out=_TT_FACTOR),
]

# --- left out: settings a plan cannot reproduce ---------------------------------------------------------

LLAMA_RECIPES = ("llama-recipes PR #41 (awgu, PyTorch FSDP maintainer), https://github.com/meta-llama/"
                 "llama-cookbook/pull/41, settings in llama-recipes@905f633d")
LLAMA_RECIPES_STACK = SoftwareStack(torch="2.0.1+cu118", cuda="11.8", transformers="4.31.0", peft="0.5.0")
_LR_LEFT_OUT = ("use_cache=True (transformers 4.31's default): every layer's keys and values stay referenced "
                "by the outputs, ~4 GB here per PR #165; orchestrate's worker trains with use_cache=False and "
                "the planner has no term for it")
for _metric, _gb in ((ALLOCATED, 15.22), (RESERVED, 19.36)):
    CASES.append(Case(
        name=f"llama2-7b lora fsdp 4xA100 ({'active' if _metric == ALLOCATED else 'reserved'})", source=LLAMA_RECIPES,
        metric=_metric, published_bytes=_gb * GiB, gpu=A100_40, gpus=4, software=LLAMA_RECIPES_STACK,
        architecture=LLAMA2_7B, fsdp1=True,
        train={"method": "lora", "seq_len": 2048, "global_batch_size": 16,
               "lora": {"r": 8, "alpha": 32, "dropout": 0.05, "dtype": "bf16", "target_modules": ["q_proj", "v_proj"]}},
        strategy=_s("fsdp", 3, "bf16", True, 4),
        settings={"model": "llama-2-7b-hf", "sharding": "FSDP1 FULL_SHARD, limit_all_gathers", "pure_bf16": True,
                  "activation checkpointing": "FSDP checkpoint wrapper per decoder layer", "batch_size_training": 4,
                  "seq": "samsum packed into 2048-token chunks", "lora": "r 8, alpha 32, dropout 0.05, q_proj v_proj",
                  "optimizer": "torch AdamW", "gpus": "4 x A100 40 GB", "metric": "peak active / reserved (GB)"},
        unpinned="GB vs GiB in the PR text; the attention implementation (eager in transformers 4.31)",
        left_out=_LR_LEFT_OUT))

PHIL_SCHMID = ("Phil Schmid, Efficiently fine-tune Llama 3 with PyTorch FSDP and Q-Lora (Apr 2024): "
               "philschmid/deep-learning-pytorch-huggingface@4a0caad:training/fsdp-qlora-distributed-llama3.ipynb, "
               "llama_3_70b_fsdp_qlora.yaml, scripts/run_fsdp_qlora.py")
CASES.append(Case(
    name="llama3-70b qlora fsdp offload 4xA10G", source=PHIL_SCHMID, metric=SMI, published_bytes=22 * GiB, gpu=A10G,
    gpus=4, software=SoftwareStack(torch="2.2.2+cu121", cuda="12.1", transformers="4.40.0", bitsandbytes="0.43.1"),
    architecture=LLAMA3_70B, accumulation=2,
    train={"method": "qlora", "seq_len": 3072, "global_batch_size": 8,
           "lora": {"r": 16, "alpha": 8, "dropout": 0.05, "dtype": "bf16", "target_modules": "auto"}},
    strategy=_s("fsdp", 3, "bf16", True, 1, offload="cpu"),
    settings={"model": "meta-llama/Meta-Llama-3-70b", "stated": "22 GB/GPU, seq 3072, batch size 1",
              "fsdp": "full_shard auto_wrap offload", "per_device_train_batch_size": 1, "gradient_accumulation_steps": 2},
    left_out=("the stated sequence length does not reach the script: the yaml's `max_seq_len: 3072` is no field of "
              "ScriptArguments (`max_seq_length`, default 512) and trl 0.8.6's TrlParser merges only matching fields "
              "(trl/commands/cli_utils.py YamlConfigParser.merge_dataclasses), so the run packed 512-token rows. "
              "Planned at the stated 3072 it reads 0.91 (the row above), at 512 lower still: below 0.95 either way, "
              "as the other FSDP1 CPU-offload rows of 70B models")))

RESERVE_PAIRS = [
    ("llama2-7b lora fsdp bs1 512 (alloc)", "llama2-7b lora fsdp bs1 512"),
    ("llama2-7b lora fsdp bs1 2048 (alloc)", "llama2-7b lora fsdp bs1 2048"),
    *((f"mistral-7b {run} (alloc)", f"mistral-7b {run} (smi)")
      for run in ("lora bs4", "lora bs8", "lora fsdp bs2", "lora fsdp bs4", "qlora fsdp bs2", "qlora fsdp bs4")),
    ("llama-7b full fsdp2 8xH100 (active)", "llama-7b full fsdp2 8xH100 (reserved)"),
]
"""Runs whose source published the allocated peak and the reserved (or nvidia-smi) one: what the caching
allocator held above the tensors, measured (nvidia-smi less the modelled CUDA context and NCCL buffers)."""
