"""A stock Hugging Face Trainer script, written against transformers only (no orchestrate import):
a tiny GPT-2 built from its config, random tokens, DeepSpeed through `TrainingArguments(deepspeed=...)`.

    python hf_trainer_script.py DEEPSPEED_JSON TRAINING_ARGS_JSON OUT_DIR

Every rank records the learning rate each optimizer step runs at (the scheduler's last lr when the
step begins) and rank 0 writes them to OUT_DIR/lrs.json."""

import json
import os
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seq_len: int, vocab: int):
        self.ids = torch.randint(0, vocab, (n, seq_len), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class RecordLr(TrainerCallback):
    def __init__(self):
        self.lrs = []

    def on_step_begin(self, args, state, control, lr_scheduler=None, **kwargs):
        self.lrs.append(lr_scheduler.get_last_lr()[0])


def main(ds_json: str, args_json: str, out_dir: str) -> None:
    with open(args_json) as f:
        kwargs = json.load(f)
    args = TrainingArguments(output_dir=out_dir, deepspeed=ds_json, use_cpu=True, report_to=[], save_strategy="no",
                             logging_steps=1, dataloader_num_workers=0, **kwargs)
    # Enough samples for max_steps optimizer steps on every rank.
    samples = args.max_steps * args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=32, vocab_size=128))
    recorder = RecordLr()
    trainer = Trainer(model=model, args=args, train_dataset=RandomTokens(samples, 16, 128), callbacks=[recorder])
    trainer.train()
    if int(os.environ.get("RANK", "0")) == 0:
        with open(os.path.join(out_dir, "lrs.json"), "w") as f:
            json.dump(recorder.lrs, f)


if __name__ == "__main__":
    main(*sys.argv[1:4])
    # As orchestrate's worker does (orchestrate/worker/__main__.py): skip C++ static destructors,
    # where a gloo rank whose peer has already exited aborts now and then under load (exit -6).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
