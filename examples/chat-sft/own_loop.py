"""The own-loop reference of examples/chat-sft: the same chat fine-tuning written as a plain
transformers + peft script (docs/own-loop.md), run under the plan of model.yaml:

    orchestrate launch --gpus 2 examples/chat-sft/model.yaml --set strategy.backend=ddp \\
        --set train.global_batch_size=14 -- python examples/chat-sft/own_loop.py --method qlora

What a user without orchestrate's data path would write: the tokenizer's chat template with
`return_assistant_tokens_mask=True` for the labels (answers only), one padded chat per row, AdamW
with the YAML's settings and transformers' cosine schedule with warm-up, LoRA / QLoRA through peft
and bitsandbytes (NF4, double quantization). At the end rank 0 answers every held-out prompt greedily
and prints the exact-match count, the number bench/sft_learning.py compares with the built-in worker's
`eval_exact_match` on the same prompts.
"""

import argparse
import json
from pathlib import Path

import torch
from torch.utils.data import DataLoader

import orchestrate

HERE = Path(__file__).resolve().parent
LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]  # orchestrate's "auto"


def load_model(base: Path, method: str):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quantized = {}
    if method == "qlora":
        quantized["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, **quantized)
    if method != "full":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=LINEARS))
    return model


def chats(path: Path) -> list[list[dict]]:
    return [json.loads(line)["messages"] for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def encode(tok, messages: list[dict]) -> dict:
    out = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids = out["input_ids"]
    return {"input_ids": ids, "labels": [t if m else -100 for t, m in zip(ids, out["assistant_masks"], strict=True)]}


def pad(tok):
    def collate(rows: list[dict]) -> dict:
        width = max(len(r["input_ids"]) for r in rows)
        batch = {"input_ids": [], "attention_mask": [], "labels": []}
        for r in rows:
            n = len(r["input_ids"])
            batch["input_ids"].append(r["input_ids"] + [tok.pad_token_id] * (width - n))
            batch["attention_mask"].append([1] * n + [0] * (width - n))
            batch["labels"].append(r["labels"] + [-100] * (width - n))
        return {k: torch.tensor(v) for k, v in batch.items()}
    return collate


def exact_matches(model, tok, held_out: list[list[dict]]) -> int:
    end = [tok.eos_token_id]
    right = 0
    model.eval()
    with torch.no_grad():
        for messages in held_out:
            prompt = tok.apply_chat_template(messages[:-1], add_generation_prompt=True, return_tensors="pt",
                                             return_dict=True)
            new = model.generate(**prompt, max_new_tokens=16, do_sample=False, eos_token_id=end, pad_token_id=end[0])
            answer = tok.decode(new[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True).strip()
            right += answer == messages[-1]["content"]
    return right


def main():
    from transformers import AutoTokenizer, get_cosine_with_min_lr_schedule_with_warmup

    parser = argparse.ArgumentParser(description="own-loop chat fine-tuning (examples/chat-sft)")
    parser.add_argument("--method", choices=["full", "lora", "qlora"], default="qlora")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--base", type=Path, default=HERE.parents[1] / "runs" / "chat-sft-base" / "model")
    parser.add_argument("--data", type=Path, default=HERE / "data")
    parser.add_argument("--seed", type=int, default=0, help="LoRA's initial values (the loader's order: train.seed)")
    parser.add_argument("--result", type=Path, help="also write {exact, of} to this JSON file")
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    tok = AutoTokenizer.from_pretrained(args.data / "tokenizer")
    model = load_model(args.base, args.method)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr,
                                  betas=(0.9, 0.95), weight_decay=0.0)
    schedule = get_cosine_with_min_lr_schedule_with_warmup(optimizer, args.warmup, args.steps, min_lr_rate=0.1)
    rows = [encode(tok, m) for m in chats(args.data / "chats.jsonl")]
    loader = DataLoader(rows, batch_size=16, shuffle=True, collate_fn=pad(tok))
    model, optimizer, loader = orchestrate.prepare(model, optimizer, loader)

    while optimizer.steps < args.steps:  # optimizer steps (each accumulates the plan's micro-batches)
        for batch in loader:
            taken = optimizer.steps
            optimizer.zero_grad()
            loss = model(**batch, use_cache=False).loss
            orchestrate.backward(loss)
            optimizer.step()
            if optimizer.steps > taken:
                schedule.step()
            if optimizer.steps >= args.steps:
                break
    if torch.distributed.get_rank() == 0:
        held_out = chats(args.data / "held_out.jsonl")
        exact = exact_matches(getattr(model, "module", model), tok, held_out)
        print(f"own-loop exact match: {exact}/{len(held_out)} (last loss {loss.item():.4f})", flush=True)
        if args.result:
            args.result.write_text(json.dumps({"exact": exact, "of": len(held_out)}))
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
