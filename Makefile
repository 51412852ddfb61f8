# One entry point for people who drive everything with make. `make demo` and `make test` each
# work alone on a fresh clone: they install into .venv first.
VENV    ?= .venv
PY      := $(VENV)/bin/python
PIP     := $(PY) -m pip
ORCH    := $(VENV)/bin/orchestrate
CONFIG  ?= examples/tiny-gpt2.yaml
GPUS    ?= 2
ARGS    ?=
# The CPU build of torch CI and this repo's machines use; see constraints-ci.txt.
CONSTRAINTS := -c constraints-ci.txt

.PHONY: install test test-fast test-unit test-methods test-e2e demo chat-base chat-sft chat-mix chat-dpo preference grpo bert-data bert-classifier bert-mlm plan launch config slurm report example-report lint bench clean services-start services-stop

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints-ci.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip wheel setuptools
	$(PIP) install -q $(CONSTRAINTS) torch==2.13.0
	$(PIP) install -q $(CONSTRAINTS) -e '.[dev,gpu,lora,export]'
	# DeepSpeed's setup.py imports torch: build it against the torch above, not a fresh CUDA one.
	$(PIP) install -q $(CONSTRAINTS) --no-build-isolation 'deepspeed>=0.15'
	# JIT-compile DeepSpeed's CPU Adam once (about a minute on a fresh machine) instead of inside a test.
	$(PY) -m orchestrate.backends.prebuild
	touch $@

# The SLURM and SSH tests need real daemons: with-daemons.sh installs (apt, once) and starts a
# two-node SLURM cluster and an sshd on loopback, runs the tests, and stops them by PID.
test: install
	bash .ci/services/with-daemons.sh $(PY) -m pytest -q --durations=15 tests

test-fast: install
	$(PY) -m pytest -q -m "not slow and not daemons" tests

# One folder of tests/ each (unit/<package>, methods/<method>, e2e), every tier; test-e2e with the
# daemons its multi-node runs need (test-unit's SLURM and SSH daemon tests skip without them).
test-unit: install
	$(PY) -m pytest -q --durations=15 tests/unit

test-methods: install
	$(PY) -m pytest -q --durations=15 tests/methods

test-e2e: install
	bash .ci/services/with-daemons.sh $(PY) -m pytest -q --durations=15 tests/e2e

demo: install
	$(ORCH) launch --gpus $(GPUS) $(CONFIG) $(ARGS)

# Chat fine-tuning (docs/sft.md, examples/chat-sft/): generated chats, a ChatML tokenizer trained on them,
# a tiny base pre-trained on generated text (once), then QLoRA on the chats and one question to the result.
CHAT_SFT := examples/chat-sft
CHAT_RUN := runs/chat-sft-$(shell date +%Y%m%d-%H%M%S)
chat-base: install
	$(PY) $(CHAT_SFT)/make_chats.py $(CHAT_SFT)/data
	test -d $(CHAT_SFT)/data/tokenizer || $(ORCH) tokenizer train $(CHAT_SFT)/tokenizer.yaml --vocab-size 640 --out $(CHAT_SFT)/data/tokenizer
	test -f runs/chat-sft-base/model/model.safetensors || $(ORCH) launch --gpus $(GPUS) $(CHAT_SFT)/base.yaml --run-dir runs/chat-sft-base
chat-sft: chat-base
	$(ORCH) launch --gpus $(GPUS) $(CHAT_SFT)/model.yaml --run-dir $(CHAT_RUN) $(ARGS)
	$(ORCH) chat $(CHAT_RUN) --adapter --prompt "Upper-case this word: lantern"

# The same QLoRA on three sources in three shapes, mixed by weight (docs/sft.md "Several datasets").
chat-mix: chat-base
	$(ORCH) launch --gpus $(GPUS) $(CHAT_SFT)/mix.yaml --run-dir runs/chat-mix-$(shell date +%Y%m%d-%H%M%S) $(ARGS)

# DPO after the newest chat-sft run (docs/preference.md): chat pairs preferring the answer with "!",
# full fine-tuning of that run's RUN_DIR/model, its reference the SFT model; then one question to the
# result (it should still answer, now with the "!").
CHAT_SFT_LAST = $(shell ls -td runs/chat-sft-2* 2>/dev/null | head -1)
CHAT_DPO_RUN := runs/chat-dpo-$(shell date +%Y%m%d-%H%M%S)
chat-dpo: install
	test -n "$(CHAT_SFT_LAST)" || (echo "run make chat-sft first" && false)
	$(PY) $(CHAT_SFT)/make_preferences.py $(CHAT_SFT)/data
	$(ORCH) launch --gpus $(GPUS) $(CHAT_SFT)/dpo.yaml --set model.name_or_path=$(abspath $(CHAT_SFT_LAST))/model --run-dir $(CHAT_DPO_RUN) $(ARGS)
	$(ORCH) chat $(CHAT_DPO_RUN) --prompt "Upper-case this word: lantern"

# DPO on generated pairs (docs/preference.md, examples/preference/): a tiny model built from its config.
preference: install
	$(PY) examples/preference/make_pairs.py examples/preference/data
	$(ORCH) launch --gpus $(GPUS) examples/preference/model.yaml $(ARGS)

# GRPO on generated prompts (docs/grpo.md, examples/grpo/): a tiny model built from its config, rewarded
# for repeating the prompt's word.
grpo: install
	$(PY) examples/grpo/make_prompts.py
	$(ORCH) launch --gpus $(GPUS) examples/grpo/model.yaml $(ARGS)

# The BERT examples (docs/tasks.md): the classifier's labelled CSVs, then each run on $(GPUS) ranks.
bert-data:
	$(PY) examples/make_labelled_csv.py examples/data

bert-classifier: install bert-data
	$(ORCH) launch --gpus $(GPUS) examples/bert-classifier.yaml $(ARGS)

bert-mlm: install
	$(ORCH) launch --gpus $(GPUS) examples/bert-mlm.yaml $(ARGS)

plan: install
	$(ORCH) plan --gpus $(GPUS) $(CONFIG) $(ARGS)

config: install
	$(ORCH) config --gpus $(GPUS) $(CONFIG) --out $(or $(OUT),runs/config) $(ARGS)

launch: install
	$(ORCH) launch --gpus $(GPUS) $(CONFIG) $(ARGS)

slurm: install
	$(ORCH) slurm $(CONFIG) $(ARGS)

# make report RUN="runs/a runs/b" [OUT=dir]: overlaid plots + summary.md (default OUT: first RUN/report).
report: install
	$(ORCH) report $(RUN) --out $(or $(OUT),$(firstword $(RUN))/report)

# examples/report.png (the README's picture): a 30-step demo run on 2 CPU ranks, its loss plot.
example-report: install
	$(ORCH) launch --gpus 2 $(CONFIG) --run-dir runs/example-report --set train.max_steps=30 --set train.eval_every=10
	$(ORCH) report runs/example-report --out runs/example-report/report
	cp runs/example-report/report/loss.png examples/report.png

services-start:
	bash .ci/services/slurm.sh start && bash .ci/services/sshd.sh start

services-stop:
	bash .ci/services/sshd.sh stop; bash .ci/services/slurm.sh stop

lint: install
	$(VENV)/bin/ruff check orchestrate tests bench

# The CPU benchmarks the README quotes (bench/README.md lists every bench and how CI runs it); both run
# even when the first misses a target, and make fails if either did. BENCH_ARGS=--short: their smoke modes.
BENCH_ARGS ?=
bench: install
	$(PY) bench/plan_speed.py $(BENCH_ARGS); status=$$?; $(PY) bench/overhead.py $(BENCH_ARGS) && exit $$status

clean:
	rm -rf runs .pytest_cache
