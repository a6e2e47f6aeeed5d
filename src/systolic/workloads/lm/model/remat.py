"""What a layer keeps for the backward pass (`model.remat`), by named activations, as MaxText's remat policies.

The layers tag the activations a policy may keep with `jax.ad_checkpoint.checkpoint_name`; a policy saves some of
them and the backward pass recomputes the rest of the layer from its input. From most memory (fastest) to least:

    none        no rematerialisation: everything the backward pass reads is kept
    dots        matmul outputs without batch dimensions and the attention kernel's output and statistics
    except_mlp  attention's projections, output and statistics; the MLP's up/gate run again (about +1/6 FLOPs)
    attn        only the attention's q, k, v and output with its statistics: the attention kernel never runs again
    context     only the attention's output and statistics: the kernel's forward never runs again
    full        only the layer's input: the whole forward pass runs again (+1/3 of the FLOPs)

The attention kernel's statistics matter on TPU: splash attention's backward needs the forward's output and log-sum-
exp; without them (a plain `dots` policy sees no matmul in a Pallas call) the whole attention forward runs again.
What each policy keeps and recomputes, in full: docs/design-notes.md, this module's section.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.ad_checkpoint import checkpoint_name

QKV = "qkv"  # q, k and v after RoPE, as the attention reads them (B, T, H or KV, hd)
CONTEXT = "context"  # the attention's output before its projection (B, T, H, hd)
ATTN_STATS = "attn_stats"  # the splash kernel's residuals: its output and log-sum-exp (splash's residual name)
ATTN_OUT = "attn_out"  # the output projection (B, T, D): with it the MLP's input is an add away


def tag(x: jax.Array, name: str) -> jax.Array:
    """x, named for the remat policies (an identity outside `jax.checkpoint`)."""
    return checkpoint_name(x, name)


# The named activations each policy that recomputes the MLP keeps (with the kernel's statistics, ATTN_STATS, but for
# full): what `policy` saves and what lm/model/sizes.py counts. none and dots keep the MLP's hidden state.
KEEPS = {"except_mlp": (QKV, CONTEXT, ATTN_OUT), "attn": (QKV, CONTEXT), "context": (CONTEXT,), "full": ()}


def policy(setting: str) -> Callable[..., bool] | None:
    """The `jax.checkpoint` policy of `model.remat=setting` (None: save nothing but the layer's input)."""
    names = jax.checkpoint_policies.save_only_these_names
    if setting == "dots":
        return jax.checkpoint_policies.save_from_both_policies(
            jax.checkpoint_policies.dots_with_no_batch_dims_saveable, names(CONTEXT, ATTN_STATS))
    assert setting in KEEPS, setting  # "none" never reaches here: the layer is not wrapped
    return names(*KEEPS[setting], ATTN_STATS) if KEEPS[setting] else None
