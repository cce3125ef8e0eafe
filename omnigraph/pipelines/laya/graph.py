"""The Laya decision graph as our own torch module, written to be exported to ONNX.

It computes exactly what `laya.common.DecisionModel.forward` computes for the sequential option
layout (ModernBERT encoder -> type embedding -> 2 pre-norm head layers -> scorer on the `[MASK]`
markers -> action head on CLS), but is shaped for an inference graph rather than for training:

- the RoPE tables (one pair per theta, the 1/sqrt(head_dim) scale folded into the queries' half)
  and both attention masks are computed once per call, not once per layer;
- queries and keys are rotated together, with `rotate_half` as one reversed slice; the fused
  projections (Wqkv, Wi) run as MatMuls on row slices of their weights, so no output is copied
  apart: fewer, larger nodes;
- local layers attend block-banded (`LocalWindows`): each block of queries scores only the keys
  its window can reach, so their attention costs O(L * window) instead of O(L^2); for short
  sequences the window covers every key and this is dense attention again;
- attention is plain MatMul / Softmax (no fused kernel), which every execution provider runs;
- parameters keep the checkpoint's names and every module's nodes its scope (`/encoder/layers.3/...`)
  in the exported graph, by which the encoder substitutions find what they replace
  (`ort_encoder.substitute_encoder` for the plain bundles, `fast_graph.substitute_encoder`).

The module is also the reference every exported graph is validated against (`export.validate_export`).

Only the exporter imports this module (it needs torch). Weights come from the checkpoint's
`model.safetensors` by their reference names, strictly: `load_checkpoint_weights`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

GLOBAL = "full_attention"
LOCAL = "sliding_attention"
# The masked-slot logit of the reference (`logits.masked_fill(~marker_mask, -1e4)`).
MASKED_LOGIT = -1e4
HEAD_NORM_EPS = 1e-5
ACT_HIDDEN = 256
# Added to attention scores of keys a query may not see; finite so a query with no visible key
# (a padding position far from the text in a local layer) stays finite instead of NaN.
_NEG = torch.finfo(torch.float32).min

class CheckpointInvalid(ValueError):
    """A checkpoint file is missing, unreadable, or does not match the architecture it declares."""


@dataclass(frozen=True)
class EncoderConfig:
    """The ModernBERT settings the graph depends on, read from `encoder/config.json`."""

    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    vocab_size: int
    pad_token_id: int
    norm_eps: float
    local_attention: int
    layer_types: tuple[str, ...]
    global_rope_theta: float
    local_rope_theta: float

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise CheckpointInvalid(f"hidden_size {self.hidden_size} is not a multiple of num_attention_heads "
                                    f"{self.num_heads}")
        if len(self.layer_types) != self.num_layers or set(self.layer_types) - {GLOBAL, LOCAL}:
            raise CheckpointInvalid(f"layer_types must name {self.num_layers} layers as {GLOBAL!r} or {LOCAL!r}")
        if LOCAL in self.layer_types and self.local_attention < 2:
            raise CheckpointInvalid(f"local_attention must be at least 2 for {LOCAL!r} layers, "
                                    f"got {self.local_attention}")
        if not 0 <= self.pad_token_id < self.vocab_size:
            raise CheckpointInvalid(f"pad_token_id {self.pad_token_id} is outside the vocabulary ({self.vocab_size})")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def sliding_window(self) -> int:
        """Half-width of a local layer's window: key j is visible from query i if |i - j| <= this."""
        return self.local_attention // 2

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], *, source: str = "encoder/config.json") -> EncoderConfig:
        """Accepts transformers 4.x keys (`global_rope_theta`, ...) and 5.x ones (`rope_parameters`)."""
        if raw.get("model_type") != "modernbert":
            raise CheckpointInvalid(f"{source}: model_type must be 'modernbert', got {raw.get('model_type')!r}")
        activation = raw.get("hidden_activation", "gelu")
        if activation != "gelu":
            raise CheckpointInvalid(f"{source}: hidden_activation {activation!r} is not supported (only exact 'gelu')")
        for flag in ("norm_bias", "attention_bias", "mlp_bias"):
            if raw.get(flag, False):
                raise CheckpointInvalid(f"{source}: {flag}=true is not supported (the Laya encoder has no biases)")
        try:
            num_layers = int(raw["num_hidden_layers"])
            every = int(raw.get("global_attn_every_n_layers", 3))
            layer_types = tuple(raw.get("layer_types") or (
                GLOBAL if i % every == 0 else LOCAL for i in range(num_layers)))
            rope_parameters = raw.get("rope_parameters")
            rope = rope_parameters if isinstance(rope_parameters, dict) else {}
            return cls(
                hidden_size=int(raw["hidden_size"]),
                num_layers=num_layers,
                num_heads=int(raw["num_attention_heads"]),
                intermediate_size=int(raw["intermediate_size"]),
                vocab_size=int(raw["vocab_size"]),
                pad_token_id=int(raw["pad_token_id"]),
                norm_eps=float(raw.get("norm_eps", 1e-5)),
                local_attention=int(raw.get("local_attention", 128)),
                layer_types=layer_types,
                global_rope_theta=float((rope.get(GLOBAL) or {}).get("rope_theta",
                                                                     raw.get("global_rope_theta", 160000.0))),
                local_rope_theta=float((rope.get(LOCAL) or {}).get("rope_theta", raw.get("local_rope_theta", 10000.0))),
            )
        except KeyError as exc:
            raise CheckpointInvalid(f"{source}: missing key {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            raise CheckpointInvalid(f"{source}: {exc}") from None


@dataclass(frozen=True)
class DecisionGraphConfig:
    """Everything that fixes the graph's structure: the encoder plus the head's two counts."""

    encoder: EncoderConfig
    head_layers: int
    n_act: int

    def __post_init__(self) -> None:
        if self.head_layers < 1:
            raise CheckpointInvalid(f"head_layers must be at least 1, got {self.head_layers}")
        if self.n_act < 1:
            raise CheckpointInvalid(f"act_costs gives {self.n_act} action outputs; at least 1 is needed")

    @classmethod
    def from_checkpoint(cls, checkpoint: Path) -> DecisionGraphConfig:
        agent = read_json(checkpoint / "rl_agent_config.json")
        for key in ("encoder", "head_layers", "act_costs"):
            if key not in agent:
                raise CheckpointInvalid(f"{checkpoint / 'rl_agent_config.json'}: missing key {key!r}")
        if not isinstance(agent["act_costs"], dict):
            raise CheckpointInvalid(f"{checkpoint / 'rl_agent_config.json'}: act_costs must be an object")
        if agent.get("option_layout", "sequential") != "sequential":
            raise CheckpointInvalid(f"{checkpoint / 'rl_agent_config.json'}: option_layout "
                                    f"{agent['option_layout']!r} is not supported (only 'sequential')")
        encoder_path = checkpoint / "encoder" / "config.json"
        return cls(
            encoder=EncoderConfig.from_dict(read_json(encoder_path), source=str(encoder_path)),
            head_layers=int(agent["head_layers"]),
            n_act=len(agent["act_costs"]) + 1,
        )


def read_json(path: Path) -> dict[str, Any]:
    """A checkpoint JSON file as an object, or CheckpointInvalid naming the file."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointInvalid(f"{path}: missing") from None
    except (OSError, ValueError) as exc:
        raise CheckpointInvalid(f"{path}: unreadable ({exc})") from None
    if not isinstance(value, dict):
        raise CheckpointInvalid(f"{path}: expected a JSON object")
    return value


def attention(q: Tensor, k: Tensor, v: Tensor, bias: Tensor) -> Tensor:
    """softmax(q k^T + bias) v on (B, H, L, Dh); q arrives pre-scaled by 1/sqrt(Dh)."""
    return torch.softmax(q @ k.transpose(-1, -2) + bias, dim=-1) @ v


@dataclass(frozen=True)
class LocalWindows:
    """A local layer's attention as blocks: N blocks of queries (half-width rows each, the last
    one padded), each scoring only the `width` consecutive keys that hold its rows' windows
    (|i - j| <= half-width), so the cost is O(L * half-width) instead of O(L^2).

    `key_index` (N, width) lists each block's keys (all inside 0..L-1: windows at the edges are
    shifted inwards, not padded); `bias` (B, 1, N, half-width, width) is 0 where the key is both in
    the query's window and a real token, and the most negative float32 elsewhere. When L <= 3 *
    half-width, width is L and every block scores every key.
    """

    key_index: Tensor
    bias: Tensor

    @classmethod
    def build(cls, key_visible: Tensor, half_width: int) -> LocalWindows:
        """From (B, L) key visibility; the block is the half-width, so a window spans 3 blocks."""
        block = half_width
        length = torch.ones_like(key_visible[0], dtype=torch.int64).sum()  # L as a tensor, also when traced
        blocks = (length + block - 1) // block
        width = length.clamp(max=block + 2 * half_width)
        first_key = (_arange(blocks) * block - half_width).clamp(min=0).minimum(length - width)
        key_index = first_key[:, None] + _arange(width)[None, :]                         # (N, width)
        query_pos = _arange(blocks * block).unflatten(0, (blocks, block))               # (N, block)
        near = (key_index[:, None, :] - query_pos[:, :, None]).abs() <= half_width      # (N, block, width)
        visible = near & key_visible[:, key_index][:, :, None, :]                         # (B, N, block, width)
        return cls(key_index=key_index, bias=torch.where(visible, 0.0, _NEG)[:, None])


def windowed_attention(q: Tensor, k: Tensor, v: Tensor, windows: LocalWindows) -> Tensor:
    """`attention` for a local layer, block by block; (B, H, L, Dh) in and out."""
    length = q.shape[2]
    blocks, block = windows.bias.shape[2], windows.bias.shape[3]
    q = F.pad(q, (0, 0, 0, blocks * block - length)).unflatten(2, (blocks, block))
    keys, values = k[:, :, windows.key_index], v[:, :, windows.key_index]           # (B, H, N, width, Dh)
    context = torch.softmax(q @ keys.transpose(-1, -2) + windows.bias, dim=-1) @ values
    return context.flatten(2, 3)[:, :, :length]


def rotate_half(x: Tensor) -> Tensor:
    """(x1, x2) -> (x2, x1) on the last dimension's halves; the sign lives in the sin table."""
    return x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)


def _arange(end: Tensor) -> Tensor:
    """`torch.arange` up to a 0-d tensor, which keeps the length symbolic when traced (torch's stubs
    only declare a number)."""
    return torch.arange(end)  # type: ignore[call-overload]


class BiasFreeLayerNorm(nn.Module):
    """ModernBERT's LayerNorm (norm_bias=False): a weight, no bias."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, None, self.eps)


class Embeddings(nn.Module):
    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.norm = BiasFreeLayerNorm(config.hidden_size, config.norm_eps)

    def forward(self, input_ids: Tensor) -> Tensor:
        return self.norm(self.tok_embeddings(input_ids))


class EncoderAttention(nn.Module):
    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        self.Wqkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=False)
        self.Wo = nn.Linear(config.hidden_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | LocalWindows) -> Tensor:
        """`cos` / `sin` (L, 2, 1, Dh) rotate queries (scaled) and keys at once; `mask` is a global
        layer's (B, 1, 1, L) bias or a local layer's windows."""
        d = self.num_heads * self.head_dim
        # Two MatMuls on row slices of Wqkv (folded into two initializers at session load) rather
        # than one whose output is then copied apart.
        qk = F.linear(x, self.Wqkv.weight[:2 * d]).unflatten(-1, (2, self.num_heads, self.head_dim))
        v = F.linear(x, self.Wqkv.weight[2 * d:])
        q, k = (qk * cos + rotate_half(qk) * sin).permute(2, 0, 3, 1, 4).unbind(0)
        v = v.unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2)
        if isinstance(mask, LocalWindows):
            context = windowed_attention(q, k, v, mask)
        else:
            context = attention(q, k, v, mask)
        return self.Wo(context.transpose(1, 2).flatten(2))


class EncoderMLP(nn.Module):
    """GeGLU: Wi -> (input, gate) -> gelu(input) * gate -> Wo."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.Wi = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.Wo = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        width = self.Wo.in_features
        hidden, gate = F.linear(x, self.Wi.weight[:width]), F.linear(x, self.Wi.weight[width:])
        return self.Wo(F.gelu(hidden) * gate)


class EncoderLayer(nn.Module):
    def __init__(self, config: EncoderConfig, index: int) -> None:
        super().__init__()
        # ModernBERT's first layer reads the (already normed) embeddings directly.
        self.attn_norm = nn.Identity() if index == 0 else BiasFreeLayerNorm(config.hidden_size, config.norm_eps)
        self.attn = EncoderAttention(config)
        self.mlp_norm = BiasFreeLayerNorm(config.hidden_size, config.norm_eps)
        self.mlp = EncoderMLP(config)
        self.layer_type = config.layer_types[index]

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | LocalWindows) -> Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, mask)
        return x + self.mlp(self.mlp_norm(x))


class Encoder(nn.Module):
    """ModernBERT: embeddings + norm, pre-norm layers alternating global and local, final norm."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = Embeddings(config)
        self.layers = nn.ModuleList(EncoderLayer(config, i) for i in range(config.num_layers))
        self.final_norm = BiasFreeLayerNorm(config.hidden_size, config.norm_eps)
        for name, theta in ((GLOBAL, config.global_rope_theta), (LOCAL, config.local_rope_theta)):
            # As transformers computes it, in float32.
            exponents = torch.arange(0, config.head_dim, 2, dtype=torch.int64).float() / config.head_dim
            self.register_buffer(f"{name}_inv_freq", 1.0 / (theta ** exponents), persistent=False)

    def rope_tables(self, positions: Tensor, layer_type: str) -> tuple[Tensor, Tensor]:
        """cos and signed sin of shape (L, 2, 1, head_dim) for queries (times 1/sqrt(head_dim)) and
        keys: rope(x) = x * cos + rotate_half(x) * sin."""
        freqs = positions.float()[:, None] * getattr(self, f"{layer_type}_inv_freq")[None, :]
        cos, sin = torch.cat((freqs, freqs), dim=-1).cos(), torch.cat((-freqs, freqs), dim=-1).sin()
        scale = self.config.head_dim ** -0.5
        return (torch.stack((cos * scale, cos), dim=1)[:, :, None, :],
                torch.stack((sin * scale, sin), dim=1)[:, :, None, :])

    def forward(self, input_ids: Tensor, key_visible: Tensor) -> Tensor:
        """`key_visible` (B, L) is True for real tokens."""
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        masks = {
            GLOBAL: torch.where(key_visible, 0.0, _NEG)[:, None, None, :],                # (B, 1, 1, L)
            LOCAL: LocalWindows.build(key_visible, self.config.sliding_window),
        }
        tables = {layer_type: self.rope_tables(positions, layer_type) for layer_type in (GLOBAL, LOCAL)}
        x = self.embeddings(input_ids)
        for layer, layer_type in zip(self.layers, self.config.layer_types):  # layer i is of layer_types[i]
            cos, sin = tables[layer_type]
            x = layer(x, cos, sin, masks[layer_type])
        return self.final_norm(x)


class HeadSelfAttention(nn.Module):
    """`nn.MultiheadAttention`'s parameters (packed in_proj, out_proj), batch-first, no dropout.

    Queries may come from fewer rows than keys and values (the last head layer's case).
    """

    def __init__(self, d: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, d // num_heads
        self.in_proj_weight = nn.Parameter(torch.empty(3 * d, d))
        self.in_proj_bias = nn.Parameter(torch.empty(3 * d))
        self.out_proj = nn.Linear(d, d)

    def forward(self, query: Tensor, context: Tensor, bias: Tensor) -> Tensor:
        d = self.num_heads * self.head_dim
        q = F.linear(query, self.in_proj_weight[:d], self.in_proj_bias[:d])
        q = q.unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2) * (self.head_dim ** -0.5)
        kv = F.linear(context, self.in_proj_weight[d:], self.in_proj_bias[d:])
        kv = kv.unflatten(-1, (2, self.num_heads, self.head_dim)).permute(2, 0, 3, 1, 4)
        return self.out_proj(attention(q, kv[0], kv[1], bias).transpose(1, 2).flatten(2))


def gather_rows(x: Tensor, rows: Tensor) -> Tensor:
    """x[b, rows[b, r]] for (B, L, d) x and (B, R) rows."""
    return torch.gather(x, 1, rows[:, :, None].expand(-1, -1, x.shape[-1]))


class HeadLayer(nn.Module):
    """`nn.TransformerEncoderLayer(d, d // 64, 4 * d, norm_first=True)` (ReLU) in eval mode."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.self_attn = HeadSelfAttention(d, max(1, d // 64))
        self.linear1 = nn.Linear(d, 4 * d)
        self.linear2 = nn.Linear(4 * d, d)
        self.norm1 = nn.LayerNorm(d, eps=HEAD_NORM_EPS)
        self.norm2 = nn.LayerNorm(d, eps=HEAD_NORM_EPS)

    def forward(self, x: Tensor, bias: Tensor, rows: Tensor | None = None) -> Tensor:
        """The layer's output at every position, or only at `rows` (B, R) when given."""
        context = self.norm1(x)
        query = context
        if rows is not None:
            x, query = gather_rows(x, rows), gather_rows(context, rows)
        x = x + self.self_attn(query, context, bias)
        return x + self.linear2(F.relu(self.linear1(self.norm2(x))))


class Head(nn.Module):
    def __init__(self, d: int, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(HeadLayer(d) for _ in range(num_layers))


class DecisionGraph(nn.Module):
    """(input_ids, attention_mask, marker_pos, marker_mask, qtype) -> (logits, act_logits)."""

    def __init__(self, config: DecisionGraphConfig) -> None:
        super().__init__()
        d = config.encoder.hidden_size
        self.encoder = Encoder(config.encoder)
        self.head = Head(d, config.head_layers)
        self.type_emb = nn.Embedding(3, d)
        self.scorer = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d), nn.GELU(), nn.Linear(d, 1))
        self.act_head = nn.Sequential(nn.Linear(d + 4, ACT_HIDDEN), nn.GELU(), nn.Linear(ACT_HIDDEN, config.n_act))
        # Present in every checkpoint and loaded strictly, never used: the config's temperatures apply.
        self.register_buffer("temperature", torch.ones(3))

    def forward(self, input_ids: Tensor, attention_mask: Tensor, marker_pos: Tensor, marker_mask: Tensor,
                qtype: Tensor) -> tuple[Tensor, Tensor]:
        key_visible = attention_mask != 0
        h = self.encoder(input_ids, key_visible)
        h = h + self.type_emb(qtype)[:, None, :]
        key_bias = torch.where(key_visible, 0.0, _NEG)[:, None, None, :]
        # After the last head layer only CLS and the markers are read, so that layer computes
        # queries, residual and feed-forward for those rows alone (keys and values: every row).
        rows = torch.cat((torch.zeros_like(marker_pos[:, :1]), marker_pos.clamp(min=0)), dim=1)
        *inner, last = self.head.layers
        for layer in inner:
            h = layer(h, key_bias)
        h = last(h, key_bias, rows)

        logits = self.scorer(h[:, 1:]).squeeze(-1)
        logits = logits.masked_fill(~marker_mask, MASKED_LOGIT)

        # The action head's confidence features, from the untempered softmax over every slot.
        p = torch.softmax(logits, dim=-1)
        k = marker_mask.sum(-1).clamp(min=2).float()
        entropy = -(p * torch.log(p.clamp_min(1e-9))).sum(-1) / torch.log(k)
        # A zero column makes top-2 defined for a single slot, as the reference pads it.
        top2 = torch.cat((p, torch.zeros_like(p[:, :1])), dim=-1).topk(2, dim=-1).values
        features = torch.stack((top2[:, 0], top2[:, 0] - top2[:, 1], entropy, k / 255.0), dim=-1)
        act_logits = self.act_head(torch.cat((h[:, 0], features), dim=-1))
        return logits, act_logits


def build_decision_graph(config: DecisionGraphConfig) -> DecisionGraph:
    """The module in eval mode; its weights come from `load_checkpoint_weights`."""
    return DecisionGraph(config).eval()


def load_checkpoint_weights(module: DecisionGraph, weights_path: Path) -> None:
    """Load `model.safetensors` into `module`: every tensor used, names and shapes checked.

    Any float dtype is accepted (the published checkpoint is fp16) and converted to float32.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        weights = load_file(str(weights_path))
    except FileNotFoundError:
        raise CheckpointInvalid(f"{weights_path}: missing") from None
    except (SafetensorError, OSError) as exc:
        raise CheckpointInvalid(f"{weights_path}: unreadable ({exc})") from None
    expected = {name: tuple(tensor.shape) for name, tensor in module.state_dict().items()}
    missing = sorted(set(expected) - set(weights))
    if missing:
        raise CheckpointInvalid(f"{weights_path}: missing tensor {missing[0]!r} (shape {expected[missing[0]]})"
                                + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
    unexpected = sorted(set(weights) - set(expected))
    if unexpected:
        raise CheckpointInvalid(f"{weights_path}: unexpected tensor {unexpected[0]!r}"
                                + (f" and {len(unexpected) - 1} more" if len(unexpected) > 1 else ""))
    for name, shape in expected.items():
        tensor = weights[name]
        if tuple(tensor.shape) != shape:
            raise CheckpointInvalid(f"{weights_path}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                                    f"expected {shape}")
        if not tensor.is_floating_point():
            raise CheckpointInvalid(f"{weights_path}: tensor {name!r} has dtype {tensor.dtype}, expected a float type")
        if not math.isfinite(float(tensor.float().abs().max())):
            raise CheckpointInvalid(f"{weights_path}: tensor {name!r} holds NaN or infinite values")
    module.load_state_dict({name: tensor.float() for name, tensor in weights.items()}, strict=True)
