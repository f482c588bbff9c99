"""A small decoder-only transformer for ``spec_decode.py``: RMSNorm, rotary attention
with a KV cache, a SwiGLU MLP, and a vocabulary-parallel LM head.

What it is built to guarantee: the logits a rank computes for its vocabulary shard
are *bitwise* the corresponding columns of the tp=1 logits, for every batch shape,
tp and device, so greedy (and seeded sampled) decoding gives the same tokens in
every mode. Two choices make that hold:

* **The trunk runs in float64 and is replicated** on every rank (only the LM head is
  sharded). Different batch shapes (a ``[pad_bs, N]`` verify batch, a ``[bs, 1]``
  plain step) pick different matmul kernels, whose results differ in the last bits;
  in float64 those differences (~1e-16) are far below anything that can move a
  token.
* **The LM head is W8A8-quantised with exact accumulation.** The final hidden state
  is rounded to integers in ``[-127, 127]`` (a static activation scale), the head
  weights to integers in ``[-127, 127]`` (one scale per tensor), and the product is
  computed in float32: every partial sum is an integer below ``64 * 127 * 127 <
  2**24``, so the matmul is exact whatever kernel, blocking or summation order
  computes it (TF32 holds such integers exactly too), and ``h_q @ W_shard.T`` is
  bitwise the slice of ``h_q @ W.T``. One float32 multiply by a fixed scale follows
  (correctly rounded, so identical everywhere).

The padded vocabulary tail (ids ``vocab_limit .. vocab_size-1``, which exist only so
that ``V`` divides by ``tp``) is *poisoned*: its logits are ``PAD_LOGIT``, larger than
any real logit, so a verify path that forgets to trim the tail (``vocab_limit``)
emits an id ``>= vocab_limit`` and the run fails loudly instead of looking right.

Weights come from a seed (:func:`make_weights`) or a state dict file
(:func:`load_weights`: ``torch.save`` or safetensors), with the names below.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = [
    "PAD_LOGIT",
    "KVCache",
    "ModelConfig",
    "TinyLM",
    "config_from_weights",
    "load_weights",
    "make_weights",
    "save_weights",
    "weight_shapes",
]

#: Logit of every padded vocabulary id: wins over every real id unless trimmed.
PAD_LOGIT = 1000.0
#: Static activation range of the quantised LM head input (the RMS-normalised hidden).
ACT_CLIP = 4.0
_Q = 127.0  # int8 range used for both operands


@dataclass(frozen=True)
class ModelConfig:
    """Shapes of the model.

    ``vocab_size`` is the padded communication vocabulary ``V`` (the default 32760
    divides by 1..8); ids ``>= vocab_limit`` are padding.
    """

    vocab_size: int = 32760
    vocab_limit: int = 32000
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    mlp: int = 128
    draft_layers: int = 1
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "vocab_limit", "hidden", "layers", "heads", "mlp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}; expected a positive int")
        if not 1 <= self.vocab_limit <= self.vocab_size:
            raise ValueError(
                f"vocab_limit={self.vocab_limit}; expected 1 <= vocab_limit <= "
                f"vocab_size={self.vocab_size}"
            )
        if self.hidden % self.heads or (self.hidden // self.heads) % 2:
            raise ValueError(
                f"hidden={self.hidden} must split into {self.heads} heads of an even size"
            )
        if not 1 <= self.draft_layers < self.layers:
            raise ValueError(
                f"draft_layers={self.draft_layers}; expected 1 <= draft_layers < "
                f"layers={self.layers} (the draft is the target's first layers)"
            )
        if self.hidden * _Q * _Q >= 2**24:
            raise ValueError(
                f"hidden={self.hidden} too large for exact float32 accumulation of the "
                f"int8 LM head (hidden * 127 * 127 must stay below 2**24)"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the state dict, name -> shape."""
    h, m, v = cfg.hidden, cfg.mlp, cfg.vocab_size
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (v, h)}
    for i in range(cfg.layers):
        p = f"layers.{i}."
        shapes[p + "attn_norm.weight"] = (h,)
        shapes[p + "attn.qkv.weight"] = (3 * h, h)
        shapes[p + "attn.out.weight"] = (h, h)
        shapes[p + "mlp_norm.weight"] = (h,)
        shapes[p + "mlp.gate_up.weight"] = (2 * m, h)
        shapes[p + "mlp.down.weight"] = (h, m)
    shapes["norm.weight"] = (h,)
    shapes["lm_head.weight"] = (v, h)
    return shapes


def make_weights(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Random float32 weights from ``seed`` (CPU generator: the same on every machine).

    The later layers' output projections are scaled down so that the draft (the
    first ``draft_layers`` layers with the same head) agrees with the target often,
    but not always.
    """
    g = torch.Generator().manual_seed(int(seed))
    out: dict[str, torch.Tensor] = {}
    for name, shape in weight_shapes(cfg).items():
        if name.endswith("norm.weight"):
            t = 1.0 + 0.1 * torch.randn(shape, generator=g)
        elif name == "embed.weight":
            t = torch.randn(shape, generator=g)
        elif name == "lm_head.weight":
            t = 0.8 * torch.randn(shape, generator=g)  # logits with a spread of about 6
            t[cfg.vocab_limit :] = 0.0  # the padded tail, as in real checkpoints
        else:
            fan_in = shape[1]
            t = torch.randn(shape, generator=g) / math.sqrt(fan_in)
            layer = int(name.split(".")[1])
            if layer >= cfg.draft_layers and name.endswith(("attn.out.weight", "down.weight")):
                t *= 0.25  # what the draft skips changes the result only sometimes
        out[name] = t.to(torch.float32).contiguous()
    return out


def config_from_weights(
    weights: dict[str, torch.Tensor],
    *,
    heads: int,
    vocab_limit: int | None,
    draft_layers: int = 1,
) -> ModelConfig:
    """The :class:`ModelConfig` a state dict implies (``heads`` cannot be read off
    the shapes; ``vocab_limit`` None: ``min(vocab_size, 32000)`` when the embedding
    has the default 32760 rows, else the whole vocabulary)."""
    if "embed.weight" not in weights:
        raise ValueError("state dict has no 'embed.weight' (not a spec_model checkpoint)")
    v, h = weights["embed.weight"].shape
    layers = 0
    while f"layers.{layers}.attn.qkv.weight" in weights:
        layers += 1
    down = weights.get("layers.0.mlp.down.weight")
    if down is None:
        raise ValueError("state dict has no 'layers.0.mlp.down.weight'")
    if vocab_limit is None:
        vocab_limit = 32000 if v == 32760 else v
    return ModelConfig(
        vocab_size=int(v),
        vocab_limit=int(vocab_limit),
        hidden=int(h),
        layers=layers,
        heads=heads,
        mlp=int(down.shape[1]),
        draft_layers=draft_layers,
    )


def check_weights(cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
    """Raise ``ValueError`` naming the first missing, extra or misshapen tensor."""
    want = weight_shapes(cfg)
    missing = sorted(set(want) - set(weights))
    extra = sorted(set(weights) - set(want))
    if missing or extra:
        raise ValueError(f"state dict keys differ: missing {missing[:4]}, unexpected {extra[:4]}")
    for name, shape in want.items():
        got = tuple(weights[name].shape)
        if got != shape:
            raise ValueError(f"{name} shape {got} != expected {shape} ({cfg})")
        if not weights[name].is_floating_point():
            raise ValueError(f"{name} dtype {weights[name].dtype}; expected a float dtype")


def save_weights(weights: dict[str, torch.Tensor], path: str | Path) -> None:
    """Write a state dict: safetensors for a ``.safetensors`` suffix, else ``torch.save``."""
    path = Path(path)
    if path.suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in weights.items()}, str(path))
    else:
        torch.save(weights, path)


def load_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """Read a state dict written by :func:`save_weights` (or any ``torch.save`` of a
    name -> tensor dict; ``weights_only``: no code from the file runs)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--weights {path}: no such file")
    if path.suffix == ".safetensors":
        try:
            from safetensors.torch import load_file
        except ImportError:
            raise ImportError(
                f"--weights {path}: reading .safetensors needs the safetensors package "
                "(pip install safetensors), or save the state dict with torch.save"
            ) from None
        return load_file(str(path), device="cpu")
    obj = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(obj, dict) and "state_dict" in obj and isinstance(obj["state_dict"], dict):
        obj = obj["state_dict"]
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise ValueError(f"--weights {path}: expected a dict of name -> tensor")
    return obj


class KVCache:
    """Keys and values of every layer: ``[layers, slots, max_len, heads, head_dim]``
    float64. Slot ``slots - 1`` is scratch space for phantom (padding) rows."""

    def __init__(self, cfg: ModelConfig, slots: int, max_len: int, device: torch.device):
        shape = (cfg.layers, slots, max_len, cfg.heads, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=torch.float64, device=device)
        self.v = torch.zeros(shape, dtype=torch.float64, device=device)
        self.max_len = max_len
        self.scratch = slots - 1


class TinyLM:
    """The target model, its early-exit draft and the rank's LM-head shard.

    Parameters
    ----------
    cfg : ModelConfig
    weights : dict name -> tensor (any float dtype; the trunk is cast to float64)
    tp, rank : int
        This rank holds LM-head rows ``[rank*V/tp, (rank+1)*V/tp)``.
    device : torch.device
    logits_dtype : torch.dtype
        dtype of the logits the head returns (float32, bfloat16 or float16).
    max_positions : int
        Longest sequence (prompt + generated + drafts) the rotary table covers.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        weights: dict[str, torch.Tensor],
        *,
        tp: int,
        rank: int,
        device: torch.device,
        logits_dtype: torch.dtype = torch.float32,
        max_positions: int = 4096,
    ) -> None:
        check_weights(cfg, weights)
        if cfg.vocab_size % tp:
            raise ValueError(f"vocab_size={cfg.vocab_size} is not a multiple of tp={tp}")
        self.cfg, self.tp, self.rank, self.device = cfg, tp, rank, device
        self.logits_dtype = logits_dtype
        f64 = {k: v.to(device=device, dtype=torch.float64) for k, v in weights.items()}
        self.embed = f64["embed.weight"]
        keys = ("attn_norm", "attn.qkv", "attn.out", "mlp_norm", "mlp.gate_up", "mlp.down")
        self.layers = [{k: f64[f"layers.{i}.{k}.weight"] for k in keys} for i in range(cfg.layers)]
        self.norm = f64["norm.weight"]
        # rotary table, computed once: a position's angles are the same in every batch
        half = cfg.head_dim // 2
        inv = cfg.rope_theta ** (-torch.arange(half, dtype=torch.float64) / half)
        ang = torch.arange(max_positions, dtype=torch.float64)[:, None] * inv[None, :]
        self._cos, self._sin = ang.cos().to(device), ang.sin().to(device)
        # the W8A8 head: integer-valued float32 weights, one scale for the tensor
        w = weights["lm_head.weight"].to(torch.float32)[: cfg.vocab_limit]
        w_scale = float(w.abs().max()) / _Q or 1.0
        self.head_q = torch.round(w / w_scale).clamp_(-_Q, _Q).to(device)  # [vocab_limit, H]
        self.logit_scale = float(torch.tensor(w_scale * ACT_CLIP / _Q, dtype=torch.float32))
        vs = cfg.vocab_size // tp
        lo = rank * vs
        shard = torch.zeros(vs, cfg.hidden, dtype=torch.float32, device=device)
        real = max(0, min(vs, cfg.vocab_limit - lo))
        shard[:real] = self.head_q[lo : lo + real]
        self.head_shard = shard  # [V/tp, H]: rows of ids lo .. lo+V/tp-1
        self.shard_real = real  # columns >= real of this shard are padding

    # -- pieces -------------------------------------------------------------------
    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        cos = self._cos[pos][:, :, None, :]  # [B, T, 1, head_dim/2]
        sin = self._sin[pos][:, :, None, :]
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)

    @staticmethod
    def _rmsnorm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    def trunk(
        self,
        tokens: torch.Tensor,
        pos: torch.Tensor,
        slots: torch.Tensor,
        cache: KVCache,
        layers: int | None = None,
    ) -> torch.Tensor:
        """Run ``layers`` (None: all) layers and the final norm; write K/V.

        Parameters
        ----------
        tokens, pos : int64 ``[B, T]``
            Token ids and their positions; row ``b`` attends to its slot's cache
            entries ``0 .. pos[b, t]`` (those of this call included).
        slots : int64 ``[B]``
            KV-cache slot of each row.

        Returns
        -------
        float64 ``[B, T, H]``, the normalised hidden state.
        """
        cfg = self.cfg
        b, t = tokens.shape
        nh, hd = cfg.heads, cfg.head_dim
        x = self.embed[tokens]
        keys = torch.arange(cache.max_len, device=self.device)
        visible = keys[None, None, None, :] <= pos[:, None, :, None]  # [B, 1, T, L]
        for i, w in enumerate(self.layers[: cfg.layers if layers is None else layers]):
            a = self._rmsnorm(x, w["attn_norm"])
            q, k, v = (a @ w["attn.qkv"].T).view(b, t, 3, nh, hd).unbind(2)
            q, k = self._rope(q, pos), self._rope(k, pos)
            cache.k[i, slots[:, None], pos] = k
            cache.v[i, slots[:, None], pos] = v
            keys_i, vals_i = cache.k[i, slots], cache.v[i, slots]  # [B, L, nh, hd]
            scores = torch.einsum("bthd,bshd->bhts", q, keys_i) / math.sqrt(hd)
            p = scores.masked_fill(~visible, float("-inf")).softmax(-1)
            o = torch.einsum("bhts,bshd->bthd", p, vals_i).reshape(b, t, cfg.hidden)
            x = x + o @ w["attn.out"].T
            m = self._rmsnorm(x, w["mlp_norm"])
            gate, up = (m @ w["mlp.gate_up"].T).chunk(2, dim=-1)
            x = x + (torch.nn.functional.silu(gate) * up) @ w["mlp.down"].T
        return self._rmsnorm(x, self.norm)

    @staticmethod
    def quantize(h: torch.Tensor) -> torch.Tensor:
        """float64 ``[..., H]`` -> integer-valued float32 in ``[-127, 127]``."""
        return torch.round(h * (_Q / ACT_CLIP)).clamp_(-_Q, _Q).to(torch.float32)

    def head_logits_shard(self, h: torch.Tensor) -> torch.Tensor:
        """This rank's logits ``[rows, V/tp]`` (``logits_dtype``) of hidden ``[rows, H]``:
        bitwise the columns ``[rank*V/tp, (rank+1)*V/tp)`` of the tp=1 logits."""
        out = self.quantize(h) @ self.head_shard.T  # exact: integers below 2**24
        out.mul_(self.logit_scale)
        out[:, self.shard_real :] = PAD_LOGIT  # the poisoned padded tail
        return out.to(self.logits_dtype)

    def draft_tokens(
        self,
        last: torch.Tensor,
        lengths: torch.Tensor,
        slots: torch.Tensor,
        cache: KVCache,
        n: int,
    ) -> torch.Tensor:
        """Propose ``n`` tokens per row greedily with the early-exit draft (the first
        ``draft_layers`` layers, the final norm and the same head, replicated on every
        rank). The draft writes its layers' K/V at positions ``lengths ..
        lengths+n-1``; the target's verify pass overwrites them.

        Returns int64 ``[B, n]``.
        """
        out = []
        cur = last
        for j in range(n):
            pos = (lengths + j)[:, None]
            h = self.trunk(cur[:, None], pos, slots, cache, self.cfg.draft_layers)
            logits = self.quantize(h[:, 0]) @ self.head_q.T  # [B, vocab_limit], exact
            cur = torch.argmax(logits, dim=-1)
            out.append(cur)
        return torch.stack(out, dim=1)
