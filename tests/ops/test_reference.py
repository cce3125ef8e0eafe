"""The NumPy references compose into transformers' own ModernBERT encoder: this pins the op
semantics (QKV layout, rotate_half RoPE per layer type, |i - j| <= local_attention // 2 windows,
key padding, exact GELU on the first half, bias-free LayerNorm) to the model Laya runs."""

from __future__ import annotations

import numpy as np
import pytest

from omnigraph.workers.ops import reference

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def test_reference_ops_reproduce_transformers_modernbert():
    config = transformers.ModernBertConfig(
        vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=2,
        local_attention=6, global_rope_theta=160000.0, local_rope_theta=10000.0, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2, attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.ModernBertModel(config).eval()
    with torch.no_grad():  # non-trivial norm weights, so a missing or misplaced norm shows
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.uniform_(0.5, 1.5)
    ids = torch.randint(3, 40, (2, 13))
    mask = torch.ones(2, 13, dtype=torch.int64)
    mask[1, 9:] = 0
    ids[1, 9:] = 0
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).last_hidden_state.numpy()

    weights = {name: value.detach().double().numpy() for name, value in model.state_dict().items()}
    mask_np = mask.numpy()
    window = config.local_attention // 2
    embedded = weights["embeddings.tok_embeddings.weight"][ids.numpy()]
    _, hidden = reference.add_layer_norm(np.zeros_like(embedded), embedded, weights["embeddings.norm.weight"])
    for i, layer_type in enumerate(config.layer_types):
        prefix = f"layers.{i}."
        if i == 0:
            attn_in = hidden  # layer 0's attn_norm is Identity
        else:
            hidden, attn_in = reference.add_layer_norm(hidden, mlp_out, weights[prefix + "attn_norm.weight"])
        local = layer_type == "sliding_attention"
        context = reference.modernbert_attention(
            attn_in @ weights[prefix + "attn.Wqkv.weight"].T, mask_np, num_heads=config.num_attention_heads,
            rope_theta=10000.0 if local else 160000.0, window=window if local else 0,
        )  # fmt: skip
        hidden, mlp_in = reference.add_layer_norm(
            hidden, context @ weights[prefix + "attn.Wo.weight"].T, weights[prefix + "mlp_norm.weight"]
        )
        mlp_out = reference.geglu(mlp_in @ weights[prefix + "mlp.Wi.weight"].T) @ weights[prefix + "mlp.Wo.weight"].T
    _, final = reference.add_layer_norm(hidden, mlp_out, weights["final_norm.weight"])

    real = mask_np.astype(bool)
    np.testing.assert_allclose(final[real], expected[real], atol=2e-5, rtol=0)
