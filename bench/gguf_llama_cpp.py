"""Does llama.cpp run what `orchestrate export --format gguf` writes as the Hugging Face model runs it?

For each family (llama, mistral, qwen2, gemma): a tiny model trained for a few hundred steps on the
family tokenizer's sentences (tests/helpers/chat_tokenizers.py, so that its next-token choices are
clear-cut, not near-ties of random weights), written by `orchestrate.gguf_export.write_gguf` (f16 and
q8_0), then loaded by llama.cpp through llama-cpp-python. It prints, per family and type: whether
llama.cpp tokenizes the prompts as the HF tokenizer does, as plain text and rendered by the chat template
(special tokens parsed, as llama.cpp's chat does), whether greedy continuations of held-out
prompts (sentences not in the training text) are token for token the HF model's, and the largest
difference of the last position's log-probabilities. With --sentencepiece [transformers|hub], llama /
mistral / gemma take a SentencePiece-converted tokenizer instead (tests/helpers/chat_tokenizers.py
`sentencepiece_tokenizer`, Llama-2's / Mistral's and Gemma's kind, in that form: "transformers", as a run
re-saves it under transformers 5, by default), written as llama.cpp's "llama" vocabulary.

Not run in CI: llama-cpp-python is built from source (a C++ build of llama.cpp: 17 minutes on one
core of the 2-core CI machine). Built and run beside the venv, not in it:
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF" \
        .venv/bin/pip wheel --no-deps -w /tmp/wheel llama-cpp-python
    .venv/bin/pip install --no-deps --target /tmp/llcpp /tmp/wheel/*.whl diskcache
    PYTHONPATH=$PWD:/tmp/llcpp .venv/bin/python bench/gguf_llama_cpp.py [--steps 300] [--tokens 12] [--sentencepiece [hub]]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import torch

from orchestrate.gguf_export import write_gguf
from tests.helpers.chat_tokenizers import (
    CORPUS,
    SENTENCEPIECE_FORMS,
    family_tokenizer,
    sentencepiece_tokenizer,
)

FAMILIES = {
    # model_type: (extra config, family tokenizer)
    "llama": ({}, "llama-3"),
    "mistral": ({"sliding_window": None}, "mistral"),
    "qwen2": ({"rope_theta": 1e6}, "qwen2"),
    "gemma": ({"head_dim": 16}, "gemma"),
}
SENTENCEPIECE = {"llama": "mistral", "mistral": "mistral", "gemma": "gemma"}
"""model_type -> the family of its SentencePiece-converted tokenizer (Llama-2 and Mistral share a layout)."""
SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 416, "max_position_embeddings": 128, "rms_norm_eps": 1e-5}
HELD_OUT = ["the dog sees the cat", "what is the capital", "you are a helpful", "apple cherry banana",
            "hello there the cat", "upper case this"]


def _trained(model_type: str, tokenizer, steps: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    extra = FAMILIES[model_type][0]
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **SHAPE, **extra))
    texts = sorted(set(CORPUS))
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(steps):
        loss = model(**batch, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    print(f"{model_type}: trained {steps} steps, loss {loss.item():.3f}")
    return model.eval()


def _hf_greedy(model, ids: list[int], n: int) -> tuple[list[int], np.ndarray]:
    """A plain argmax loop over whole-sequence forwards (generate() would take a bos id equal to its
    pad id for padding and mask it)."""
    out: list[int] = []
    with torch.no_grad():
        last = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1).numpy()
        for _ in range(n):
            out.append(int(model(torch.tensor([ids + out])).logits[0, -1].argmax()))
    return out, last


def _llama_cpp_greedy(llm, ids: list[int], n: int) -> tuple[list[int], np.ndarray]:
    llm.reset()
    llm.eval(ids)
    first = np.asarray(llm.scores[llm.n_tokens - 1], dtype=np.float64)
    last = first - np.log(np.exp(first - first.max()).sum()) - first.max()
    out = []
    for _ in range(n):
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        out.append(token)
        llm.eval([token])
    return out, last


def main() -> None:
    from llama_cpp import Llama
    from transformers import AutoTokenizer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--tokens", type=int, default=12)
    parser.add_argument("--families", nargs="*", default=None, help="default: all, or all with a SentencePiece kind")
    parser.add_argument("--sentencepiece", nargs="?", const="transformers", choices=SENTENCEPIECE_FORMS,
                        help="SentencePiece-converted tokenizers, in this form")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for model_type in args.families or list(SENTENCEPIECE if args.sentencepiece else FAMILIES):
            root = Path(tmp) / model_type
            tokenizer_dir = (sentencepiece_tokenizer(root / "tokenizer", SENTENCEPIECE[model_type], args.sentencepiece)
                             if args.sentencepiece else family_tokenizer(root / "tokenizer", FAMILIES[model_type][1]))
            tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
            model = _trained(model_type, tokenizer, args.steps)
            for quant in ("f16", "q8_0"):
                out = root / quant
                out.mkdir()
                write_gguf(dict(model.state_dict()), model.config, tokenizer_dir, out, quant, print)
                llm = Llama(model_path=str(out / "model.gguf"), n_ctx=128, logits_all=True, verbose=False)
                same_tokens = same_chat = same_greedy = 0
                worst = 0.0
                for prompt in HELD_OUT:
                    ids = tokenizer(prompt)["input_ids"]
                    same_tokens += llm.tokenize(prompt.encode(), add_bos=True, special=False) == ids
                    chat = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                         add_generation_prompt=True)
                    same_chat += (llm.tokenize(chat.encode(), add_bos=False, special=True)
                                  == tokenizer(chat, add_special_tokens=False)["input_ids"])
                    hf, hf_last = _hf_greedy(model, ids, args.tokens)
                    cpp, cpp_last = _llama_cpp_greedy(llm, ids, args.tokens)
                    same_greedy += hf == cpp
                    worst = max(worst, float(np.abs(hf_last - cpp_last).max()))
                    if hf != cpp:
                        print(f"  {prompt!r}: HF {tokenizer.decode(hf)!r} / llama.cpp {tokenizer.decode(cpp)!r}")
                print(f"{model_type} {quant}: tokenization {same_tokens}/{len(HELD_OUT)} equal, as chat prompts "
                      f"{same_chat}/{len(HELD_OUT)}, greedy "
                      f"{same_greedy}/{len(HELD_OUT)} equal ({args.tokens} tokens), max |log-prob diff| {worst:.4f}")
                del llm


if __name__ == "__main__":
    main()
