"""The mask arithmetic of orchestrate/methods/prune/masks.py in one process (no process group):
exact thresholds, global vs per-layer scope, channel masks, master copies."""

from __future__ import annotations

import torch

from orchestrate.methods.prune import masks as prune_masks


class _Block(torch.nn.Module):
    def __init__(self, h: int, i: int):
        super().__init__()
        self.mlp = torch.nn.Module()
        self.mlp.gate_proj, self.mlp.up_proj = torch.nn.Linear(h, i, bias=False), torch.nn.Linear(h, i, bias=False)
        self.mlp.down_proj = torch.nn.Linear(i, h, bias=False)


class _Model(torch.nn.Module):
    def __init__(self, h: int = 8, i: int = 12, layers: int = 2):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Linear(h, h)  # outside the blocks: never pruned
        self.layers = torch.nn.ModuleList(_Block(h, i) for _ in range(layers))
        with torch.no_grad():  # layer 1 ten times larger: a global threshold prunes it less
            for p in self.layers[1].parameters():
                p.mul_(10)


KINDS = {"gate_proj", "up_proj", "down_proj"}


def test_views_are_the_block_linears_only():
    views = prune_masks.prunable_views(_Model(), KINDS)
    assert [v.name for v in views] == [f"layers.{n}.mlp.{k}.weight" for n in (0, 1)
                                       for k in ("gate_proj", "up_proj", "down_proj")]
    assert [v.layer for v in views] == [0, 0, 0, 1, 1, 1] and all(v.offset == 0 and not v.masters for v in views)
    assert prune_masks.replication(views) == 1


def test_global_threshold_prunes_exactly_k_smallest_magnitudes():
    views = prune_masks.prunable_views(_Model(), KINDS)
    flat = torch.cat([v.local.abs() for v in views])
    masks = prune_masks.magnitude_masks(views, 0.3, per_layer=False, rep=1)
    kept = torch.cat(masks)
    k = int(0.3 * flat.numel())
    assert int((~kept).sum()) == k
    assert flat[~kept].max() < flat[kept].min()  # exactly the k smallest
    layer_sparsity = [float((~torch.cat(masks[3 * n:3 * n + 3])).float().mean()) for n in (0, 1)]
    assert layer_sparsity[0] > 0.55 and layer_sparsity[1] < 0.05, layer_sparsity  # global: unequal layers


def test_per_layer_scope_prunes_each_matrix_alike_and_masks_apply_to_every_copy():
    model = _Model()
    views = prune_masks.prunable_views(model, KINDS)
    masks = prune_masks.magnitude_masks(views, 0.5, per_layer=True, rep=1)
    assert [int((~m).sum()) for m in masks] == [v.local.numel() // 2 for v in views]
    hit = []
    views[0].masters.append(lambda mask: hit.append(int((~mask).sum())))
    prune_masks.apply_masks(views, masks)
    assert hit == [48] and prune_masks.measured_sparsity(views, 1) == 0.5
    assert int((model.layers[0].mlp.gate_proj.weight == 0).sum()) == 48  # the module's own weight
    assert int((model.embed.weight == 0).sum()) == 0
    assert all(bool((prune_masks.magnitude_masks(views, 0.0, True, 1)[j]).all()) for j in range(len(views)))


def test_channel_masks_drop_whole_channels_of_smallest_norm():
    model = _Model()
    with torch.no_grad():  # channel 3 of block 0 tiny in all three matrices
        model.layers[0].mlp.gate_proj.weight[3] *= 1e-3
        model.layers[0].mlp.up_proj.weight[3] *= 1e-3
        model.layers[0].mlp.down_proj.weight[:, 3] *= 1e-3
    views = prune_masks.prunable_views(model, KINDS)
    masks = prune_masks.structured_masks(views, 0.25, channels=12)
    gate, up, down = (m.view(v.shape) for m, v in zip(masks[:3], views[:3], strict=True))
    dropped = (~gate).all(1).nonzero().flatten().tolist()
    assert len(dropped) == 3 and 3 in dropped  # 25 % of 12 channels, the tiny one among them
    assert (~up).all(1).nonzero().flatten().tolist() == dropped == (~down).all(0).nonzero().flatten().tolist()
    assert int((~gate).sum()) == 3 * 8  # whole rows, nothing else


def test_head_masks_drop_the_same_number_of_query_heads_in_every_kv_group():
    torch.manual_seed(0)
    h, d, heads, kv = 8, 2, 4, 2
    attn = torch.nn.Module()
    attn.q_proj, attn.o_proj = torch.nn.Linear(h, heads * d, bias=False), torch.nn.Linear(heads * d, h, bias=False)
    model = _Model(h=h)
    model.layers[0].self_attn = attn
    with torch.no_grad():  # heads 0 and 1 share kv head 0; head 1 is tiny, head 3 (group 1) too
        for j in (1, 3):
            attn.q_proj.weight[j * d:(j + 1) * d] *= 1e-3
            attn.o_proj.weight[:, j * d:(j + 1) * d] *= 1e-3
    views = prune_masks.prunable_views(model, KINDS | {"q_proj", "o_proj"})
    masks = dict(zip((v.name for v in views), prune_masks.structured_masks(views, 0.5, 12, heads, kv, d), strict=True))
    q = masks["layers.0.self_attn.q_proj.weight"].view(heads * d, h)
    o = masks["layers.0.self_attn.o_proj.weight"].view(h, heads * d)
    assert q.all(1).tolist() == [True] * 2 + [False] * 2 + [True] * 2 + [False] * 2  # heads 1 and 3 dropped
    assert o.all(0).tolist() == q.all(1).tolist() and not bool(q[2:4].any())
    assert int((~masks["layers.1.mlp.gate_proj.weight"]).sum()) == 6 * h  # the MLP alongside: 6 of 12 channels
