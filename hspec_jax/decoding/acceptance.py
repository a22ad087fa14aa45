"""Acceptance rules for verifying k drafted tokens against the target's k+1 distributions.

Both return (n, next_token): n `[B]` in 0..k drafted tokens accepted, and the token that follows them
(the target's correction at position n, or the bonus token when all k are accepted). Every committed
token is therefore distributed exactly as the target would have produced it alone:

* `greedy_accept`: accept while the draft equals the target's argmax; next = argmax at position n.
* `speculative_accept` (temperature > 0): accept draft i with probability min(1, p_i(d_i) / q_i(d_i)),
  where q_i is the distribution d_i was drawn from; on the first rejection draw from
  norm(max(p_n - q_n, 0)); if all k are accepted draw the bonus from p_k.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def accepted_prefix(ok: jax.Array) -> jax.Array:
    """`[B, k]` bool -> `[B]` length of the all-True prefix."""
    return jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=-1), axis=-1)


def greedy_accept(draft: jax.Array, target_logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """draft `[B, k]` target ids; target_logits `[B, k+1, V]` at the anchor and each draft -> (n, next)."""
    choice = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # [B, k+1]
    n = accepted_prefix(draft == choice[:, :-1])
    return n, jnp.take_along_axis(choice, n[:, None], axis=1)[:, 0]


def speculative_accept(rng: jax.Array, draft: jax.Array, q: jax.Array, p: jax.Array) -> tuple[jax.Array, jax.Array]:
    """draft `[B, k]`; q `[B, k, V]` draft distributions over the target vocabulary; p `[B, k+1, V]` target
    distributions (same temperature / top-k / top-p processing) -> (n, next). See the module docstring."""
    batch, k = draft.shape
    accept_rng, residual_rng = jax.random.split(rng)
    p_d = jnp.take_along_axis(p[:, :k], draft[..., None], axis=-1)[..., 0]
    q_d = jnp.take_along_axis(q, draft[..., None], axis=-1)[..., 0]
    u = jax.random.uniform(accept_rng, (batch, k))
    n = accepted_prefix(u * q_d < p_d)  # u < p/q, without dividing by q
    p_n = jnp.take_along_axis(p, n[:, None, None], axis=1)[:, 0]  # [B, V]
    q_padded = jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1)  # q_k = 0: the bonus draws from p_k
    residual = jnp.maximum(p_n - jnp.take_along_axis(q_padded, n[:, None, None], axis=1)[:, 0], 0.0)
    total = residual.sum(-1, keepdims=True)
    # A rejection implies p(d) < q(d), hence positive residual mass; the fallback only guards rounding.
    residual = jnp.where(total > 0, residual / jnp.where(total > 0, total, 1.0), p_n)
    next_token = jax.random.categorical(residual_rng, jnp.log(residual), axis=-1).astype(jnp.int32)
    return n, next_token
