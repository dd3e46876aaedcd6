"""A PyTorch twin of maxlite's decoders, built from the same Config, loading maxlite params as-is.

Shape legend as in maxlite/models/layers.py (B batch, T time, D model, N query heads, K kv heads,
G = N/K, H head dim, F mlp, V vocab). Parameters keep maxlite's names and layouts (q [D,N,H],
o [N,H,D], gate [D,F], ...; layers as `layers.<i>.<leaf>`), so loading is a copy, not a
conversion. Numerics follow the JAX model: norms and softmax in float32, RoPE in split halves
(with Llama 3.1 scaling), tanh-approximated GELU, causal attention within segment ids (and within a
sliding window, Mistral-style). The twin models the llama2 and gpt3 blocks; the newer families'
traits (q/k norms, post-norms, Gemma's norms and embeddings, interleaved windows) it refuses: their
reference is transformers itself (`python -m maxlite.bridge.hf export`, then AutoModelForCausalLM),
as tests/test_bridge_hf_families.py checks.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from maxlite.bridge import params as P
from maxlite.models.families import family, has_qk_norm
from maxlite.models.layout import layer_kinds, layer_windows
from maxlite.bridge import require

torch = require("torch")
nn, F = torch.nn, torch.nn.functional

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _normal(shape, std: float) -> nn.Parameter:
    return nn.Parameter(torch.randn(*shape) * std)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.scale, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x_BTD):
        x = x_BTD.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x * self.scale.float()).to(x_BTD.dtype)


class LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.scale, self.bias = nn.Parameter(torch.ones(dim)), nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x_BTD):
        x = F.layer_norm(x_BTD.float(), x_BTD.shape[-1:], self.scale.float(), self.bias.float(), self.eps)
        return x.to(x_BTD.dtype)


def apply_rope(x_BTNH, positions_BT, inv_freq, scale=1.0):
    """maxlite.models.layers.apply_rope: the first 2·len(inv_freq) dims rotated (× YaRN's scale)."""
    angles_BTh = positions_BT[..., None].float() * inv_freq
    sin, cos = torch.sin(angles_BTh)[:, :, None, :] * scale, torch.cos(angles_BTh)[:, :, None, :] * scale
    x = x_BTNH.float()
    rotary = 2 * inv_freq.shape[-1]
    x1, x2 = x[..., :rotary].chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., rotary:]], dim=-1).to(x_BTNH.dtype)


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        D, N, K, H, s = (cfg.base_emb_dim, cfg.base_num_query_heads, cfg.base_num_kv_heads,
                         cfg.head_dim, cfg.init_scale)
        self.q, self.k = _normal((D, N, H), s), _normal((D, K, H), s)
        self.v, self.o = _normal((D, K, H), s), _normal((N, H, D), s)
        self.use_bias = cfg.use_bias
        if cfg.use_bias:
            self.q_bias, self.k_bias = nn.Parameter(torch.zeros(N, H)), nn.Parameter(torch.zeros(K, H))
            self.v_bias, self.o_bias = nn.Parameter(torch.zeros(K, H)), nn.Parameter(torch.zeros(D))
        self.use_rope = family(cfg).rope
        if self.use_rope:
            from maxlite.models.layers import rope_attention_factor, rope_frequencies  # one definition for both twins

            # A float32 constant, not a buffer: it stays float32 under .to(bfloat16) (as in JAX)
            # and needs no care when the module is built on the meta device.
            self.inv_freq = rope_frequencies(cfg).astype(np.float32)
            self.rope_scale = rope_attention_factor(cfg)
        self.group = N // K

    def forward(self, x_BTD, positions_BT, mask_B1TS):
        q_BTNH = torch.einsum("btd,dnh->btnh", x_BTD, self.q)
        k_BSKH = torch.einsum("bsd,dkh->bskh", x_BTD, self.k)
        v_BSKH = torch.einsum("bsd,dkh->bskh", x_BTD, self.v)
        if self.use_bias:
            q_BTNH, k_BSKH, v_BSKH = q_BTNH + self.q_bias, k_BSKH + self.k_bias, v_BSKH + self.v_bias
        if self.use_rope:
            inv_freq = torch.from_numpy(self.inv_freq).to(x_BTD.device)
            q_BTNH = apply_rope(q_BTNH, positions_BT, inv_freq, self.rope_scale)
            k_BSKH = apply_rope(k_BSKH, positions_BT, inv_freq, self.rope_scale)
        # Query head n uses kv head n // G (maxlite splits N into [K, G]): repeat each kv head G times.
        k_BSNH = k_BSKH.repeat_interleave(self.group, dim=2)
        v_BSNH = v_BSKH.repeat_interleave(self.group, dim=2)
        out_BNTH = F.scaled_dot_product_attention(
            q_BTNH.transpose(1, 2), k_BSNH.transpose(1, 2), v_BSNH.transpose(1, 2), attn_mask=mask_B1TS)
        out_BTD = torch.einsum("bnth,nhd->btd", out_BNTH, self.o)
        return out_BTD + self.o_bias if self.use_bias else out_BTD


class SwiGLU(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        D, Fd, s = cfg.base_emb_dim, cfg.base_mlp_dim, cfg.init_scale
        self.gate, self.up, self.down = _normal((D, Fd), s), _normal((D, Fd), s), _normal((Fd, D), s)

    def forward(self, x_BTD):
        return (F.silu(x_BTD @ self.gate) * (x_BTD @ self.up)) @ self.down


class GeluMLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        D, Fd, s = cfg.base_emb_dim, cfg.base_mlp_dim, cfg.init_scale
        self.up, self.down = _normal((D, Fd), s), _normal((Fd, D), s)
        self.up_bias, self.down_bias = nn.Parameter(torch.zeros(Fd)), nn.Parameter(torch.zeros(D))

    def forward(self, x_BTD):  # jax.nn.gelu defaults to the tanh approximation
        return F.gelu(x_BTD @ self.up + self.up_bias, approximate="tanh") @ self.down + self.down_bias


NORMS = {"rmsnorm": RMSNorm, "layernorm": LayerNorm}  # by Family.norm
MLPS = {"swiglu": SwiGLU, "gelu": GeluMLP}  # by Family.mlp


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        norm = NORMS[family(cfg).norm]
        self.attn_norm = norm(cfg.base_emb_dim, cfg.normalization_layer_epsilon)
        self.attn = Attention(cfg)
        self.mlp_norm = norm(cfg.base_emb_dim, cfg.normalization_layer_epsilon)
        self.mlp = MLPS[family(cfg).mlp](cfg)

    def forward(self, x_BTD, positions_BT, mask_B1TS):
        x_BTD = x_BTD + self.attn(self.attn_norm(x_BTD), positions_BT, mask_B1TS)
        return x_BTD + self.mlp(self.mlp_norm(x_BTD))


def check_supported(cfg) -> None:
    """One line for a model the twin does not model."""
    fam = family(cfg)
    unmodelled = [what for what, present in (
        ("q/k norms", has_qk_norm(cfg)), ("norms after attention and the MLP", fam.post_norms),
        ("no pre-norms", not fam.pre_norms), ("scaled embeddings", fam.embed_scale),
        ("(1 + w) norms", fam.norm_offset), ("a mixture of experts", fam.moe), ("a GeGLU MLP", fam.mlp == "geglu"),
        ("q/k/v biases without an o bias", fam.biases == "qkv"),
        ("a second RoPE base", cfg.local_rope_max_timescale), ("a query scalar", cfg.query_pre_attn_scalar),
        ("local and global layers", len(set(layer_windows(cfg))) > 1),
        ("a squared-ReLU MLP", fam.mlp == "relu2"),
        ("Mamba-2 layers, or layers without a mixer or an MLP",
         any(k.mixer in ("mamba2", "none") or k.ffn == "none" for k in layer_kinds(cfg)))) if present]
    if unmodelled:
        raise ValueError(f"decoder_block={cfg.decoder_block}: the torch twin does not model {', '.join(unmodelled)}; "
                         f"for this model transformers is the reference (hf export, then AutoModelForCausalLM)")


class TorchTransformer(nn.Module):
    """inputs_BT (+ positions_BT, segment_ids_BT; default one document from 0) → logits_BTV float32."""

    def __init__(self, cfg):
        super().__init__()
        check_supported(cfg)
        self.cfg = cfg
        D, V, s = cfg.base_emb_dim, cfg.vocab_size, cfg.init_scale
        self.embedding = _normal((V, D), s)
        if family(cfg).positions == "learned":
            self.positions = _normal((cfg.max_position_embeddings, D), s)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.base_num_decoder_layers))
        norm = NORMS[family(cfg).norm]
        self.final_norm = norm(D, cfg.normalization_layer_epsilon)
        if not cfg.logits_via_embedding:
            self.unembedding = _normal((D, V), s)

    def forward(self, inputs_BT, positions_BT=None, segment_ids_BT=None):
        B, T = inputs_BT.shape
        if positions_BT is None:
            positions_BT = torch.arange(T, device=inputs_BT.device).expand(B, T)
        if segment_ids_BT is None:
            segment_ids_BT = torch.ones_like(inputs_BT)
        causal_TS = torch.ones(T, T, dtype=torch.bool, device=inputs_BT.device).tril()
        if self.cfg.sliding_window:  # keys i − W < j ≤ i
            causal_TS = causal_TS & ~torch.ones_like(causal_TS).tril(-self.cfg.sliding_window)
        mask_B1TS = (causal_TS & (segment_ids_BT[:, :, None] == segment_ids_BT[:, None, :]))[:, None]
        x_BTD = self.embedding[inputs_BT]
        if family(self.cfg).positions == "learned":
            x_BTD = x_BTD + self.positions[positions_BT]
        for layer in self.layers:
            x_BTD = layer(x_BTD, positions_BT, mask_B1TS)
        x_BTD = self.final_norm(x_BTD)
        head_DV = self.embedding.T if self.cfg.logits_via_embedding else self.unembedding
        return (x_BTD @ head_DV).float()


# ---- maxlite params in and out ----

def _leaf_names(model: TorchTransformer) -> dict[str, tuple]:
    """torch name → maxlite path ('layers.3.attn.q' → ('layers', 3, 'attn', 'q'))."""
    out = {}
    for name, _ in model.named_parameters():
        parts = name.split(".")
        out[name] = tuple(int(p) if p.isdigit() else p for p in parts)
    return out


def load_maxlite_params(model: TorchTransformer, params) -> TorchTransformer:
    """Copy maxlite params (nnx.State or nested dict; stacked or per-layer) into the twin."""
    pure, cfg = P.to_pure(params), model.cfg
    with torch.no_grad():
        for name, path in _leaf_names(model).items():
            if path[0] == "layers":
                value = P.layer_leaf(pure, cfg, path[1], path[2:])
            else:
                value = P.get(pure, path)
            target = model.get_parameter(name)
            if tuple(value.shape) != tuple(target.shape):
                raise ValueError(f"maxlite param {'/'.join(map(str, path))} has shape {value.shape}, "
                                 f"the config implies {tuple(target.shape)}")
            target.copy_(torch.from_numpy(np.array(value, dtype=np.float32)).to(target.dtype))
    return model


def maxlite_params(model: TorchTransformer) -> dict[str, Any]:
    """The twin's weights as a maxlite nested numpy dict (stacked when cfg.scan_layers)."""
    cfg, pure = model.cfg, {}
    per_layer: dict[int, dict] = {}
    for name, path in _leaf_names(model).items():
        value = model.get_parameter(name).detach().float().cpu().numpy()
        if path[0] == "layers":
            P.put(per_layer.setdefault(path[1], {}), path[2:], value)
        else:
            P.put(pure, path, value)
    if cfg.scan_layers:
        first = per_layer[0]
        pure["layers"] = {}
        for path, _ in P.leaves(first):
            P.put(pure["layers"], path, np.stack([P.get(per_layer[i], path) for i in sorted(per_layer)]))
    else:
        pure["layers"] = per_layer
    return pure


def from_maxlite(cfg, params=None, device: str = "cpu") -> TorchTransformer:
    """The twin for `cfg` in cfg.weight_dtype, with maxlite params loaded when given.

    With params, the module is built on the meta device and allocated once in its final dtype:
    no random init to throw away and no float32 copy of a bfloat16 model.
    """
    dtype = DTYPES[cfg.weight_dtype]
    if params is None:
        model = TorchTransformer(cfg).to(device=device, dtype=dtype)
    else:
        with torch.device("meta"):
            model = TorchTransformer(cfg).to(dtype)
        model = model.to_empty(device=device)
    return model if params is None else load_maxlite_params(model, params)


# ---- training in PyTorch with maxlite's recipe ----

def learning_rate(cfg, step: int) -> float:
    """maxlite's schedule, written again in plain Python on purpose (an independent twin of optim.py,
    tested against it on every schedule): linear warmup from 0, then cosine/linear/constant (or stable then a
    warmup-stable-decay's decay) to the schedule's end (`schedule_steps`), held after it; an alignment run's warm-up
    (`alignment_sft_steps` at `alignment_sft_learning_rate`) first, the schedule spanning the rest."""
    n = cfg.alignment_sft_steps
    if n and cfg.alignment_sft_learning_rate:
        if step < n:
            return cfg.alignment_sft_learning_rate
        rest = dataclasses.replace(cfg, alignment_sft_steps=0, alignment_sft_learning_rate=0.0,
                                   learning_rate_schedule_steps=max(cfg.schedule_steps - n, 1))
        return learning_rate(rest, step - n)
    peak, warmup = cfg.learning_rate, cfg.warmup_steps
    if step < warmup:
        return peak * step / warmup
    if cfg.lr_schedule_type == "wsd":  # the peak, then the decay over the schedule's last steps
        start, n = cfg.schedule_steps - cfg.wsd_decay_steps, cfg.wsd_decay_steps
        t = 0.0 if step < start else min((step - start) / max(n, 1), 1.0)
        left = {"linear": 1 - t, "cosine": 0.5 * (1 + math.cos(math.pi * t)), "1-sqrt": 1 - math.sqrt(t)}
        return peak * (cfg.learning_rate_final_fraction + (1 - cfg.learning_rate_final_fraction) * left[cfg.wsd_decay_style])
    t = min(step - warmup, max(cfg.schedule_steps - warmup, 1)) / max(cfg.schedule_steps - warmup, 1)
    final = cfg.learning_rate_final_fraction
    if cfg.lr_schedule_type == "cosine":
        return peak * ((1 - final) * 0.5 * (1 + math.cos(math.pi * t)) + final)
    if cfg.lr_schedule_type == "linear":
        return peak * (1 + (final - 1) * t)
    return peak


def make_optimizer(model: TorchTransformer, cfg):
    """AdamW with maxlite's hyper-parameters (no decay on norm scales and biases) + LR schedule."""
    if cfg.opt_type != "adamw":
        raise ValueError(f"opt_type={cfg.opt_type}: the torch twin trains with AdamW only; use opt_type=adamw")
    if cfg.first_moment_dtype != cfg.weight_dtype or (cfg.weight_dtype == "float32" and cfg.grad_dtype != "float32"):
        raise ValueError(f"mu_dtype={cfg.mu_dtype or '(weight_dtype)'} grad_dtype={cfg.grad_dtype}: the torch twin keeps "
                         f"Adam's moments and the gradients in weight_dtype={cfg.weight_dtype}; unset them")
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        leaf = name.split(".")[-1]
        (no_decay if leaf == "scale" or leaf.endswith("bias") else decay).append(p)
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.adam_weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.learning_rate, betas=(cfg.adam_b1, cfg.adam_b2), eps=cfg.adam_eps)
    scale = 1.0 / cfg.learning_rate if cfg.learning_rate else 0.0
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: learning_rate(cfg, s) * scale)
    return optimizer, scheduler


def loss_fn(model: TorchTransformer, batch: dict, z_loss_weight: float = 0.0):
    """(mean loss over real tokens incl. z-loss, mean cross-entropy, number of real tokens)."""
    b = {k: torch.as_tensor(np.asarray(v)) for k, v in batch.items()}
    logits_BTV = model(b["inputs"].long(), b["positions"].long(), b["segment_ids"])
    log_z_BT = torch.logsumexp(logits_BTV, dim=-1)
    target_BT = logits_BTV.gather(-1, b["targets"].long()[..., None])[..., 0]
    weights_BT = b["weights"].float()
    tokens = weights_BT.sum().clamp(min=1.0)
    xent = ((log_z_BT - target_BT) * weights_BT).sum() / tokens
    loss = xent + z_loss_weight * (log_z_BT.square() * weights_BT).sum() / tokens
    return loss, xent, weights_BT.sum()


def train_step(model: TorchTransformer, optimizer, scheduler, batch: dict, cfg) -> dict[str, float]:
    """One optimizer step on a maxlite batch (numpy dict); returns maxlite's metric names."""
    model.train()
    optimizer.zero_grad(set_to_none=True)
    lr = scheduler.get_last_lr()[0]
    loss, xent, weights = loss_fn(model, batch, cfg.z_loss_weight)
    loss.backward()
    max_norm = cfg.gradient_clipping_threshold if cfg.gradient_clipping_threshold > 0 else math.inf
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    optimizer.step()
    scheduler.step()
    return {"loss": xent.item(), "grad_norm": grad_norm.item(), "learning_rate": lr,
            "total_weights": weights.item()}
