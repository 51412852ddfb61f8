"""Small model.yaml texts the config tests share."""

MINIMAL = """\
model:
  architecture: {model_type: gpt2, n_embd: 64, n_layer: 2, n_head: 4}
train:
  seq_len: 128
  global_batch_size: 8
"""
"""The smallest config that plans: a tiny GPT-2 shape and the two required train fields."""
