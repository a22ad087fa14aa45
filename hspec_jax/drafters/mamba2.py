"""Mamba-2 mixer with an injected initial SSM state, and three interchangeable forms of its scan.

Shapes: B batch (blocks), L block length, D model dim, H SSM heads, P head dim, N state dim, G groups
(head h reads group h // (H/G)). The recurrence, per head, with S_{-1} = S0 `[B, H, P, N]`:

    S_t = exp(dt_t * A) * S_{t-1} + dt_t * (x_t ⊗ B_t)        y_t = S_t · C_t + D * x_t

`ssd_sequential` (a `lax.scan` reference), `ssd_associative` (`lax.associative_scan`) and `ssd_chunked`
(the SSD form: quadratic inside a chunk, a scan across chunks) compute the same thing; `ssd` picks one.
All of dt, A, the decays and the state are fp32.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from hspec_jax.models.layers import INIT_STD, dense

SCAN_IMPLS = ("sequential", "associative", "chunked")
# Measured on CPU (benchmarks/results/drafter_forward.md, "Mamba-2 scan forms"): fastest at block 8.
DEFAULT_SCAN = "chunked"
GATED_NORM_EPS = 1e-5  # hard-coded in the reference gated RMSNorm, not the config's eps


@dataclasses.dataclass(frozen=True)
class MambaConfig:
    """Mamba-2 mixer shape. The inner width is num_heads * head_dim (the paper's expand=1 recipe)."""

    num_heads: int
    head_dim: int = 64
    d_state: int = 4
    n_groups: int = 4
    conv_kernel: int = 4
    scan: str = DEFAULT_SCAN
    chunk_size: int = 8

    def __post_init__(self):
        if self.num_heads % self.n_groups:
            raise ValueError(f"mamba num_heads={self.num_heads} must be a multiple of n_groups={self.n_groups}")
        if self.scan not in SCAN_IMPLS:
            raise ValueError(f"unknown mamba scan {self.scan!r}; choose one of {SCAN_IMPLS}")

    @property
    def d_inner(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the depthwise conv: x, B and C together."""
        return self.d_inner + 2 * self.n_groups * self.d_state

    @property
    def state_shape(self) -> tuple[int, int, int]:
        """Per-sequence SSM state `[H, P, N]`."""
        return (self.num_heads, self.head_dim, self.d_state)


def _per_head(bc: jax.Array, num_heads: int) -> jax.Array:
    """`[B, L, G, N]` -> `[B, L, H, N]`: head h reads group h // (H/G) (contiguous blocks, not tiled)."""
    return jnp.repeat(bc, num_heads // bc.shape[2], axis=2)


def ssd_sequential(x, dt, A, B, C, D, S0):
    """Reference recurrence, one step at a time. x `[B, L, H, P]`, dt `[B, L, H]` (post-softplus), A `[H]`
    (negative), B/C `[B, L, G, N]`, D `[H]`, S0 `[B, H, P, N]` -> (y `[B, L, H, P]` fp32, final `[B, H, P, N]`)."""
    Bh, Ch = _per_head(B, x.shape[2]), _per_head(C, x.shape[2])

    def step(state, inputs):
        x_t, dt_t, b_t, c_t = inputs  # [B,H,P], [B,H], [B,H,N], [B,H,N]
        decay = jnp.exp(dt_t * A)[..., None, None]
        state = decay * state + (dt_t[..., None] * x_t)[..., None] * b_t[:, :, None, :]
        y_t = jnp.einsum("bhpn,bhn->bhp", state, c_t) + D[:, None] * x_t
        return state, y_t

    xs = tuple(jnp.moveaxis(a.astype(jnp.float32), 1, 0) for a in (x, dt, Bh, Ch))
    final, ys = jax.lax.scan(step, S0.astype(jnp.float32), xs)
    return jnp.moveaxis(ys, 0, 1), final


def ssd_associative(x, dt, A, B, C, D, S0):
    """Same contract as `ssd_sequential`, as a parallel prefix scan over (decay, input) pairs."""
    x, dt = x.astype(jnp.float32), dt.astype(jnp.float32)
    Bh, Ch = _per_head(B, x.shape[2]).astype(jnp.float32), _per_head(C, x.shape[2]).astype(jnp.float32)
    decay = jnp.exp(dt * A)  # [B, L, H]
    inputs = jnp.einsum("blh,blhp,blhn->blhpn", dt, x, Bh)
    inputs = inputs.at[:, 0].add(decay[:, 0, :, None, None] * S0.astype(jnp.float32))

    def combine(earlier, later):
        a1, b1 = earlier
        a2, b2 = later
        return a1 * a2, a2[..., None, None] * b1 + b2

    _, states = jax.lax.associative_scan(combine, (decay, inputs), axis=1)  # [B, L, H, P, N]
    y = jnp.einsum("blhpn,blhn->blhp", states, Ch) + D[:, None] * x
    return y, states[:, -1]


def ssd_chunked(x, dt, A, B, C, D, S0, chunk_size: int = 8):
    """Same contract as `ssd_sequential`, in the SSD form: inside each chunk of `chunk_size` tokens the output
    is a masked quadratic ("attention-like") product; the state is carried across chunks by a scan.
    L is padded to a multiple of the chunk with dt = 0 (decay 1, no input), which leaves the state unchanged."""
    b, length, h, p = x.shape
    pad = (-length) % chunk_size
    x, dt = x.astype(jnp.float32), dt.astype(jnp.float32)
    Bh, Ch = _per_head(B, h).astype(jnp.float32), _per_head(C, h).astype(jnp.float32)
    if pad:
        widths = lambda a: [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2)
        x, dt, Bh, Ch = (jnp.pad(a, widths(a)) for a in (x, dt, Bh, Ch))
    chunks = (length + pad) // chunk_size
    split = lambda a: jnp.moveaxis(a.reshape(b, chunks, chunk_size, *a.shape[2:]), 1, 0)  # [c, B, Q, ...]
    xc, dtc, bc, cc = split(x), split(dt), split(Bh), split(Ch)
    causal = jnp.tril(jnp.ones((chunk_size, chunk_size), bool))

    def chunk(state, inputs):
        x_c, dt_c, b_c, c_c = inputs  # [B,Q,H,P], [B,Q,H], [B,Q,H,N], [B,Q,H,N]
        log_decay = jnp.cumsum(dt_c * A, axis=1)  # [B, Q, H], cumulative from the chunk start
        # exp(cum_t - cum_s) for s <= t; the exponent is masked before exp (no 0 * inf).
        seg = log_decay[:, :, None, :] - log_decay[:, None, :, :]  # [B, Qt, Qs, H]
        seg = jnp.exp(jnp.where(causal[None, :, :, None], seg, -jnp.inf))
        scores = jnp.einsum("bthn,bshn->btsh", c_c, b_c) * seg * dt_c[:, None, :, :]
        y = jnp.einsum("btsh,bshp->bthp", scores, x_c)
        y += jnp.exp(log_decay)[..., None] * jnp.einsum("bthn,bhpn->bthp", c_c, state)
        to_end = jnp.exp(log_decay[:, -1:, :] - log_decay) * dt_c  # [B, Q, H]
        state = jnp.exp(log_decay[:, -1])[..., None, None] * state + jnp.einsum("bsh,bshp,bshn->bhpn", to_end, x_c, b_c)
        return state, y

    final, ys = jax.lax.scan(chunk, S0.astype(jnp.float32), (xc, dtc, bc, cc))
    y = jnp.moveaxis(ys, 0, 1).reshape(b, length + pad, h, p)[:, :length]
    return y + D[:, None] * x[:, :length], final


def ssd(x, dt, A, B, C, D, S0, impl: str = DEFAULT_SCAN, chunk_size: int = 8):
    """Dispatch to one of the three equivalent scan forms (see the module docstring)."""
    if impl == "sequential":
        return ssd_sequential(x, dt, A, B, C, D, S0)
    if impl == "associative":
        return ssd_associative(x, dt, A, B, C, D, S0)
    if impl == "chunked":
        return ssd_chunked(x, dt, A, B, C, D, S0, chunk_size)
    raise ValueError(f"unknown mamba scan {impl!r}; choose one of {SCAN_IMPLS}")


def causal_depthwise_conv(x: jax.Array, kernel: jax.Array, bias: jax.Array) -> jax.Array:
    """x `[B, L, C]`, kernel `[K, C]`, bias `[C]` -> `[B, L, C]`; zero history before the block
    (out_t = bias + sum_k kernel[k] * x_{t-K+1+k}, so kernel[K-1] weights the current token)."""
    k = kernel.shape[0]
    padded = jnp.pad(x, [(0, 0), (k - 1, 0), (0, 0)])
    out = sum(padded[:, i : i + x.shape[1]] * kernel[i] for i in range(k))
    return out + bias


def gated_rms_norm(y: jax.Array, z: jax.Array, scale: jax.Array, out_dtype) -> jax.Array:
    """`rmsnorm(y * silu(z)) * scale` over the full inner width, in fp32, eps 1e-5 (reference semantics)."""
    u = y.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))
    u = u * jax.lax.rsqrt(jnp.mean(u * u, axis=-1, keepdims=True) + GATED_NORM_EPS)
    return u.astype(out_dtype) * scale.astype(out_dtype)


class DepthwiseConv(nn.Module):
    """Causal depthwise conv over `[B, L, C]` with a `[K, C]` kernel and `[C]` bias (zero history), computed in
    fp32 and cast back to the input dtype (as vLLM's path for short blocks)."""

    kernel_size: int
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        channels = x.shape[-1]
        kernel = self.param("kernel", nn.initializers.normal(INIT_STD), (self.kernel_size, channels), self.param_dtype)
        bias = self.param("bias", nn.initializers.zeros, (channels,), self.param_dtype)
        f32 = lambda a: a.astype(jnp.float32)
        return causal_depthwise_conv(f32(x), f32(kernel), f32(bias)).astype(x.dtype)


class Mamba2Mixer(nn.Module):
    """in_proj -> (z, xBC, dt) -> causal depthwise conv + SiLU -> SSD scan from S0 -> gated norm -> out_proj.

    Parameter names follow the reference checkpoint (`in_proj`, `conv1d`, `A_log`, `D`, `dt_bias`, `norm`,
    `out_proj`); `conv1d.kernel` is `[K, C]` (torch's `[C, 1, K]` transposed).
    """

    hidden_size: int
    config: MambaConfig
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, state0: jax.Array | None = None):
        """x `[B, L, D]`, state0 `[B, H, P, N]` (None = zeros) -> (y `[B, L, D]`, final state `[B, H, P, N]`)."""
        cfg = self.config
        b, length, _ = x.shape
        h, gn = cfg.num_heads, cfg.n_groups * cfg.d_state
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        zxbcdt = dense(cfg.d_inner + cfg.conv_dim + h, "in_proj", **kw)(x)
        z, xbc, dt = jnp.split(zxbcdt, [cfg.d_inner, cfg.d_inner + cfg.conv_dim], axis=-1)
        xbc = jax.nn.silu(DepthwiseConv(cfg.conv_kernel, self.dtype, self.param_dtype, name="conv1d")(xbc))
        xs, bs, cs = jnp.split(xbc, [cfg.d_inner, cfg.d_inner + gn], axis=-1)
        a_log = self.param("A_log", lambda _, n: jnp.log(jnp.arange(1, n + 1, dtype=jnp.float32)), h)
        d_skip = self.param("D", nn.initializers.ones, (h,), jnp.float32)
        dt_bias = self.param("dt_bias", nn.initializers.zeros, (h,), jnp.float32)
        dt = jax.nn.softplus(dt.astype(jnp.float32) + dt_bias.astype(jnp.float32))
        if state0 is None:
            state0 = jnp.zeros((b, *cfg.state_shape), jnp.float32)
        y, final = ssd(
            xs.reshape(b, length, h, cfg.head_dim),
            dt,
            -jnp.exp(a_log.astype(jnp.float32)),
            bs.reshape(b, length, cfg.n_groups, cfg.d_state),
            cs.reshape(b, length, cfg.n_groups, cfg.d_state),
            d_skip.astype(jnp.float32),
            state0,
            cfg.scan,
            cfg.chunk_size,
        )
        scale = self.param("norm", nn.initializers.ones, (cfg.d_inner,), self.param_dtype)
        # The scan's fp32 output is rounded to the compute dtype before the (fp32) gated norm, as the reference.
        y = gated_rms_norm(y.reshape(b, length, cfg.d_inner).astype(self.dtype), z, scale, self.dtype)
        return dense(self.hidden_size, "out_proj", **kw)(y), final
