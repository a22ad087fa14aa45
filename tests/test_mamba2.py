"""Mamba-2 with an injected state: the three scan forms agree, and the mixer matches an independent fp64 numpy
implementation of the reference semantics."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hspec_jax.drafters.mamba2 import (
    SCAN_IMPLS,
    Mamba2Mixer,
    MambaConfig,
    ssd,
    ssd_associative,
    ssd_chunked,
    ssd_sequential,
)


def random_scan_inputs(seed, batch=2, length=8, heads=8, head_dim=16, d_state=4, groups=4):
    """Float32 inputs of one scan, drawn with numpy (no per-shape XLA program)."""
    rng = np.random.default_rng(seed)

    def normal(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    x = 0.5 * normal(batch, length, heads, head_dim)
    dt = np.logaddexp(0.0, normal(batch, length, heads) - 1.0).astype(np.float32)  # softplus
    a = -np.exp(normal(heads))
    b = 0.5 * normal(batch, length, groups, d_state)
    c = 0.5 * normal(batch, length, groups, d_state)
    d = normal(heads)
    s0 = 0.5 * normal(batch, heads, head_dim, d_state)
    return x, dt, a, b, c, d, s0


# Each form as one program per shape, as a drafter runs it (run op by op, each shape compiled dozens of programs).
SEQUENTIAL, ASSOCIATIVE = jax.jit(ssd_sequential), jax.jit(ssd_associative)
CHUNKED = jax.jit(ssd_chunked, static_argnames="chunk_size")
SSD = jax.jit(ssd, static_argnames=("impl", "chunk_size"))


def numpy_recurrence(x, dt, a, b, c, d, s0):
    """fp64 loop straight from the definition; head h reads group h // (H / G)."""
    x, dt, a, b, c, d, s0 = (np.asarray(v, np.float64) for v in (x, dt, a, b, c, d, s0))
    _, length, heads, _ = x.shape
    per_group = heads // b.shape[2]
    state, ys = s0.copy(), np.zeros_like(x)
    for t in range(length):
        for h in range(heads):
            g = h // per_group
            state[:, h] = np.exp(dt[:, t, h] * a[h])[:, None, None] * state[:, h] + (
                dt[:, t, h][:, None, None] * x[:, t, h][:, :, None] * b[:, t, g][:, None, :]
            )
            ys[:, t, h] = np.einsum("bpn,bn->bp", state[:, h], c[:, t, g]) + d[h] * x[:, t, h]
    return ys, state


@pytest.mark.parametrize("length", [1, 2, 3, 7, 8, 9, 16, 33, 64])
def test_scan_forms_agree(length):
    inputs = random_scan_inputs(length, length=length)
    y_ref, s_ref = SEQUENTIAL(*inputs)
    for y, s in (ASSOCIATIVE(*inputs), CHUNKED(*inputs, chunk_size=8), CHUNKED(*inputs, chunk_size=5)):
        np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(s), np.asarray(s_ref), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("length", [1, 8, 13])
def test_sequential_matches_fp64_definition(length):
    inputs = random_scan_inputs(100 + length, length=length)
    y, s = SEQUENTIAL(*inputs)
    y64, s64 = numpy_recurrence(*inputs)
    np.testing.assert_allclose(np.asarray(y), y64, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(s), s64, atol=1e-5, rtol=1e-5)


def test_injected_state_is_used():
    x, dt, a, b, c, d, s0 = random_scan_inputs(7)
    y_seeded, _ = SSD(x, dt, a, b, c, d, s0)
    y_zero, _ = SSD(x, dt, a, b, c, d, jnp.zeros_like(s0))
    assert float(jnp.abs(y_seeded - y_zero).max()) > 1e-2
    # The contribution of S0 to y_t is exactly exp(sum dt*A) * (C_t . S0): linear in S0.
    y_only_state, _ = SSD(jnp.zeros_like(x), dt, a, b, c, d, s0)
    np.testing.assert_allclose(np.asarray(y_seeded - y_zero), np.asarray(y_only_state), atol=1e-5)


def numpy_mixer(params, x, s0, cfg: MambaConfig, eps=1e-5):
    """The reference mixer in fp64: in_proj split [z, xBC, dt], causal depthwise conv (zero history) + SiLU,
    dt = softplus(dt + dt_bias), A = -exp(A_log), recurrence from S0, D skip, full-width gated RMSNorm, out_proj."""
    p = jax.tree.map(lambda v: np.asarray(v, np.float64), params)
    x = np.asarray(x, np.float64)
    silu = lambda v: v / (1 + np.exp(-v))
    zxbcdt = x @ p["in_proj"]["kernel"]
    z, xbc, dt = np.split(zxbcdt, [cfg.d_inner, cfg.d_inner + cfg.conv_dim], axis=-1)
    k = cfg.conv_kernel
    padded = np.pad(xbc, [(0, 0), (k - 1, 0), (0, 0)])
    conv = sum(padded[:, i : i + x.shape[1]] * p["conv1d"]["kernel"][i] for i in range(k)) + p["conv1d"]["bias"]
    xbc = silu(conv)
    gn = cfg.n_groups * cfg.d_state
    xs, bs, cs = np.split(xbc, [cfg.d_inner, cfg.d_inner + gn], axis=-1)
    dt = np.log1p(np.exp(dt + p["dt_bias"]))
    batch, length = x.shape[:2]
    y, state = numpy_recurrence(
        xs.reshape(batch, length, cfg.num_heads, cfg.head_dim),
        dt,
        -np.exp(p["A_log"]),
        bs.reshape(batch, length, cfg.n_groups, cfg.d_state),
        cs.reshape(batch, length, cfg.n_groups, cfg.d_state),
        p["D"],
        s0,
    )
    u = y.reshape(batch, length, cfg.d_inner) * silu(z)
    u = u / np.sqrt(np.mean(u * u, axis=-1, keepdims=True) + eps) * p["norm"]
    return u @ p["out_proj"]["kernel"], state


@pytest.mark.parametrize("scan", SCAN_IMPLS)
def test_mixer_matches_fp64_reference(scan):
    cfg = MambaConfig(num_heads=8, head_dim=16, d_state=4, n_groups=4, scan=scan)
    mixer = Mamba2Mixer(48, cfg)
    x = jax.random.normal(jax.random.key(0), (2, 8, 48))
    s0 = 0.3 * jax.random.normal(jax.random.key(1), (2, *cfg.state_shape))
    params = jax.jit(mixer.init)(jax.random.key(2), x, s0)["params"]
    # Non-trivial values for every parameter the init leaves at a constant.
    keys = iter(jax.random.split(jax.random.key(3), 8))
    params["dt_bias"] = jax.random.normal(next(keys), params["dt_bias"].shape) - 2.0
    params["D"] = jax.random.normal(next(keys), params["D"].shape)
    params["norm"] = 1 + 0.2 * jax.random.normal(next(keys), params["norm"].shape)
    params["conv1d"]["bias"] = 0.1 * jax.random.normal(next(keys), params["conv1d"]["bias"].shape)
    params["conv1d"]["kernel"] = 0.5 * jax.random.normal(next(keys), params["conv1d"]["kernel"].shape)
    y, state = jax.jit(mixer.apply)({"params": params}, x, s0)
    y64, state64 = numpy_mixer(params, x, s0, cfg)
    np.testing.assert_allclose(np.asarray(y), y64, atol=1e-5, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(state), state64, atol=1e-5, rtol=1e-4)


def test_mixer_parameter_layout_and_init():
    cfg = MambaConfig(num_heads=48, head_dim=64, d_state=4, n_groups=4)
    shapes = jax.eval_shape(lambda: Mamba2Mixer(4096, cfg).init(jax.random.key(0), jnp.zeros((1, 8, 4096)))["params"])
    assert shapes["in_proj"]["kernel"].shape == (4096, 6224)  # z 3072 + xBC 3104 + dt 48, as the reference
    assert shapes["conv1d"]["kernel"].shape == (4, 3104) and shapes["out_proj"]["kernel"].shape == (3072, 4096)
    assert shapes["norm"].shape == (3072,) and shapes["A_log"].shape == (48,)
    params = Mamba2Mixer(32, MambaConfig(num_heads=4, head_dim=8, n_groups=2)).init(
        jax.random.key(0), jnp.zeros((1, 8, 32))
    )["params"]
    np.testing.assert_allclose(np.asarray(params["A_log"]), np.log(np.arange(1, 5)), rtol=1e-6)
    assert np.all(np.asarray(params["D"]) == 1) and np.all(np.asarray(params["dt_bias"]) == 0)


def test_unknown_scan_is_rejected():
    with pytest.raises(ValueError, match="unknown mamba scan"):
        MambaConfig(num_heads=4, scan="fft")
    with pytest.raises(ValueError, match="multiple of n_groups"):
        MambaConfig(num_heads=6, n_groups=4)


@pytest.fixture(scope="module")
def random_mixer_params():
    """A mixer's parameters (8 heads of 16, 4 groups of state 4, width 48), every one perturbed off its init."""
    mixer = Mamba2Mixer(48, MambaConfig(num_heads=8, head_dim=16, d_state=4, n_groups=4))
    params = jax.jit(mixer.init)(jax.random.key(0), jnp.zeros((2, 1, 48)), jnp.zeros((2, 8, 16, 4)))["params"]
    return jax.tree.map(lambda p: p + 0.1 * jax.random.normal(jax.random.key(7), p.shape), params)


@pytest.mark.parametrize("length", [1, 5, 8, 17, 64])
def test_mixer_scan_forms_agree_with_random_params(length, random_mixer_params):
    rng = np.random.default_rng(length)
    x = rng.standard_normal((2, length, 48)).astype(np.float32)
    s0 = 0.5 * rng.standard_normal((2, 8, 16, 4)).astype(np.float32)
    outs = {
        scan: jax.jit(Mamba2Mixer(48, MambaConfig(8, 16, 4, 4, scan=scan)).apply)(
            {"params": random_mixer_params}, x, s0
        )
        for scan in SCAN_IMPLS
    }
    for scan in SCAN_IMPLS[1:]:
        for got, want in zip(outs[scan], outs["sequential"], strict=True):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
