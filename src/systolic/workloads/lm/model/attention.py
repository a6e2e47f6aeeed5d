"""Causal grouped-query attention for training, with one implementation per platform.

    platform  `model.attention=auto` picks                                        (T, T) scores in memory
    tpu       splash: JAX's Pallas splash attention kernel, under shard_map        no
              (xla where splash cannot: a sequence length not a multiple of 128)
    gpu       cudnn: cuDNN flash attention, `jax.nn.dot_product_attention`         no
              (xla where cuDNN cannot: float32, head size not a multiple of 8 or over 128)
    cpu       cpu: `lm/model/cpu.py`'s formulation (xla when SYSTOLIC_CPU_TWEAKS turns it off)   yes

Every implementation masks packed documents (`segment_ids`) to causal AND same segment and takes a sliding window
(`model.sliding_window`); logit soft-capping (Gemma 2) is splash's own or `masked_attention`'s, the plain
formulation written here (also what decoding with a KV cache runs), and attention sinks (GPT-OSS) are only in
`masked_attention`: auto picks it where a kernel cannot, and the config refuses a forced kernel that cannot.
`model.attention=splash|cudnn|xla` forces one (`splash` off a TPU runs in Pallas's interpreter). The platform is the
traced program's (`runtime.platform.compile_platform`): compiling for compile-only TPU devices on a CPU host picks
splash. How each implementation takes each feature: docs/design-notes.md, this module's section.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax.core import spmd
from jax.experimental.pallas.ops.tpu import splash_attention as splash

from systolic.errors import ConfigError
from systolic.runtime.platform import compile_platform, device_platform
from systolic.runtime.sharding import logical_to_spec
from systolic.kernels.splash import tuned_block_sizes as splash_blocks
from systolic.workloads.lm.model import cpu, remat

SETTINGS = ("auto", "splash", "cudnn", "xla")  # the values of model.attention
IMPLEMENTATIONS = ("splash", "cudnn", "xla", "cpu")  # what `choose` returns
# Splash's key blocks must be multiples of the TPU's 128 lanes; 512 is MaxText's default block (min'ed with T).
SPLASH_BLOCKS = (512, 256, 128)


def choose(setting: str, *, dtype: jnp.dtype, head_dim: int, seq_len: int, segments: bool = False,
           softcap: bool = False, sinks: bool = False) -> str:
    """The implementation that `model.attention=setting` means for the program being traced, one of
    IMPLEMENTATIONS; raises a ConfigError for a forced one that this platform, dtype, head size or sequence length
    cannot run (`segments`: with packed documents' segment ids; `softcap`: with soft-capped logits, which cuDNN
    and the cpu formulation do not compute; `sinks`: with attention sinks, which only xla computes)."""
    platform = compile_platform()
    if setting == "auto" and sinks:
        return "xla"
    if setting == "auto":
        if platform == "tpu":
            return "splash" if seq_len % SPLASH_BLOCKS[-1] == 0 else "xla"
        if platform == "gpu":  # a GPU plan traces GPU code but compiles it on CPU devices: no cuDNN kernel there
            takes = _cudnn_takes(dtype, head_dim) and not (segments and seq_len % 2) and not softcap
            return "cudnn" if device_platform() == "gpu" and takes else "xla"
        return "cpu" if cpu.cpu_tweak("attention") and not softcap else "xla"
    if setting == "cudnn" and device_platform() != "gpu":
        raise ConfigError(
            f"model.attention=cudnn needs an NVIDIA GPU, but this program is compiled for {platform}. Fix: "
            "model.attention=auto (splash on TPU, cuDNN on GPU, the CPU formulation on CPU) or model.attention=xla."
        )
    if setting == "cudnn" and not _cudnn_takes(dtype, head_dim):
        raise ConfigError(
            f"model.attention=cudnn: cuDNN flash attention takes bfloat16 or float16 with a head size that is a "
            f"multiple of 8 and at most 128, but got {jnp.dtype(dtype).name} with head size {head_dim}. Fix: "
            "model.dtype=bfloat16 and a head size like 64 or 128 (model.d_model / model.heads, or model.head_dim), "
            "or model.attention=auto, which falls back to xla here."
        )
    if setting == "cudnn" and segments and seq_len % 2:
        raise ConfigError(
            f"model.attention=cudnn with data.packing=documents: the documents' mask reaches cuDNN as an additive "
            f"bias, and cuDNN's training kernel takes a bias only for an even sequence length, but data.seq_len="
            f"{seq_len}. Fix: an even data.seq_len (e.g. {seq_len + 1}), or model.attention=auto, which falls back to "
            "xla here."
        )
    if setting == "splash":
        splash_block(seq_len)  # a ConfigError, with the fix, for a length the kernel cannot split
    assert setting in SETTINGS, setting  # the config schema checks the value
    return setting


def _cudnn_takes(dtype: jnp.dtype, head_dim: int) -> bool:
    # jax's own check (cudnn/fused_attention_stablehlo.py) allows head sizes up to 256 on Hopper and later, but it
    # asks the GPU at trace time; 128 holds on every GPU that cuDNN flash attention supports.
    return jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) and head_dim % 8 == 0 and head_dim <= 128


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, impl: str, segment_ids: jax.Array | None = None,
                     window: int = 0, softcap: float = 0.0, sinks: jax.Array | None = None) -> jax.Array:
    """Causal grouped-query attention with `impl` (one of IMPLEMENTATIONS, see `choose`): q (B, T, H, hd), k and
    v (B, T, KV, hd), H a multiple of KV, query head h reading key/value head h // (H // KV) -> (B, T, H, hd).
    With `segment_ids` (B, T) int32 a query attends only to keys of its own segment (packed documents); with
    `window` W > 0 only to keys at most W - 1 positions before it; with `softcap` > 0 the scaled logits s become
    softcap * tanh(s / softcap); with `sinks` (H,) float32 each head's sink logit joins its softmax's denominator."""
    if impl == "splash":
        assert sinks is None, "the config refuses splash with sinks"
        return splash_attention(q, k, v, segment_ids, window=window, softcap=softcap)
    if softcap or sinks is not None:
        assert impl == "xla", impl  # `choose` picks xla for a cap or sinks; the config refuses a forced cudnn
        T = q.shape[1]
        positions = jnp.arange(T)
        mask = decode_mask(positions, T, window)[None]  # (1, T, T)
        if segment_ids is not None:
            mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])  # (B, T, T)
        return masked_attention(q, k, v, mask, softcap=softcap, sinks=sinks)
    if impl == "cpu":
        return cpu.causal_attention(q, k, v, segment_ids, window=window)
    assert impl in ("cudnn", "xla"), impl
    # (B, 1, T, T), shared by the heads. is_causal stays on with it: cuDNN then skips the blocks above the diagonal.
    mask = None if segment_ids is None else (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]
    local = (window - 1, 0) if window else None  # (left, right) keys around the query, the query excluded
    # jax's own XLA formulation adds float32 statistics to bfloat16 scores; that implicit promotion is its choice,
    # so it runs under standard promotion even where a caller (the tests) makes promotion strict.
    with jax.numpy_dtype_promotion("standard"):
        return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, local_window_size=local,
                                            implementation=impl)


def decode_mask(positions: jax.Array, keys: int, window: int | jax.Array) -> jax.Array:
    """(T, S) bool: queries at positions (T,) may read keys at positions [0, S) at or before them and, with a
    sliding window W > 0, after position - W (Hugging Face's convention: the query and the W - 1 positions before
    it). `window` may be traced (a scan over layers of both kinds); 0 means no window."""
    key_positions = jnp.arange(keys)[None, :]  # (1, S)
    mask = key_positions <= positions[:, None]  # (T, S)
    if isinstance(window, int):
        return mask & (key_positions > positions[:, None] - window) if window else mask
    return mask & ((key_positions > positions[:, None] - window) | (window <= 0))


def masked_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, *, softcap: float = 0.0,
                     sinks: jax.Array | None = None) -> jax.Array:
    """Grouped-query attention in plain JAX under an explicit mask, with optional logit soft-capping: q (B, T, H, hd),
    k and v (B, S, KV, hd), mask (B or 1, T, S) bool (True: may attend) -> (B, T, H, hd). Scores and softmax in
    float32, as transformers' eager attention computes them. With `sinks` (H,) float32, head h's softmax is over
    its scores and one more logit sinks[h] whose probability is dropped (GPT-OSS): the weights sum to less than 1."""
    B, T, H, hd = q.shape
    KV = k.shape[2]
    qg = q.reshape(B, T, KV, H // KV, hd)  # (B, T, KV, G, hd): query head h reads key/value head h // G
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) / math.sqrt(hd)  # (B, KV, G, T, S)
    if softcap:
        s = softcap * jnp.tanh(s / softcap)
    s = jnp.where(mask[:, None, None], s, -jnp.inf)
    if sinks is None:
        p = jax.nn.softmax(s, axis=-1).astype(v.dtype)  # (B, KV, G, T, S); every query sees at least itself
    else:
        sink = sinks.astype(jnp.float32).reshape(KV, H // KV)[None, :, :, None, None]  # (1, KV, G, 1, 1)
        m = jnp.maximum(jnp.max(s, axis=-1, keepdims=True), sink)  # (B, KV, G, T, 1): the sink's logit included
        e = jnp.exp(s - m)  # (B, KV, G, T, S)
        p = (e / (jnp.sum(e, axis=-1, keepdims=True) + jnp.exp(sink - m))).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", p, v, preferred_element_type=jnp.float32)  # (B, T, KV, G, hd)
    return out.reshape(B, T, H, hd).astype(q.dtype)


def splash_block(seq_len: int) -> int:
    """The splash block size (queries and keys, forward and backward) for sequences of seq_len."""
    for block in SPLASH_BLOCKS:
        if seq_len % block == 0:
            return block
    raise ConfigError(
        f"TPU splash attention splits the sequence into blocks of 128, 256 or 512 positions, but got sequences of "
        f"{seq_len} positions. Fix: data.seq_len a multiple of 128 (e.g. {max(128, round(seq_len / 128) * 128)}), "
        "or model.attention=xla (the plain formulation, which holds the (T, T) scores in memory)."
    )


def splash_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None = None, *,
                     window: int = 0, softcap: float = 0.0,
                     tiles: splash_blocks.SplashTiles | None = None) -> jax.Array:
    """`causal_attention` with the splash kernel, run by Pallas's interpreter off a TPU, in `tiles` (default: the
    chip's, `splash_blocks.tiles_for`; benchmarks/kernels/splash_blocks.py times candidates through this argument).

    Under a mesh the kernel runs per device in a shard_map over the batch and head axes of the current sharding
    rules: a Pallas kernel is opaque to XLA's SPMD partitioner, which would otherwise gather every operand onto
    each device. The sequence stays whole (a split one takes lm/parallel/context.py's attention); the grouping is
    unchanged by the head split because the rules split `heads` and `kv_heads` over the same mesh axes, so each
    device holds whole groups."""
    local = functools.partial(_splash_local, interpret=device_platform() != "tpu", window=window, softcap=softcap,
                              tiles=tiles)
    operands = (q, k, v) if segment_ids is None else (q, k, v, segment_ids)
    rules = spmd.get_logical_axis_rules()
    mesh = jax.sharding.get_abstract_mesh()
    if not rules or mesh.empty:
        return local(*operands)
    q_spec = logical_to_spec(("batch", "seq", "heads", "head_dim"), rules)
    kv_spec = logical_to_spec(("batch", "seq", "kv_heads", "head_dim"), rules)
    # The sequence's axis (context) has size 1 here: a split sequence takes lm/parallel/context.py's attention instead.
    assert q_spec[3] is None and q_spec[2] == kv_spec[2], (q_spec, kv_spec)
    segment_spec = jax.sharding.PartitionSpec(q_spec[0], q_spec[1])  # (B, T): the rows of q's shard
    in_specs = (q_spec, kv_spec, kv_spec, segment_spec)[: len(operands)]
    # check_vma=False: the kernel declares its outputs without the varying-axes type that the check needs.
    return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=q_spec, check_vma=False)(*operands)


def _splash_local(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None = None, *,
                  interpret: bool, window: int, softcap: float,
                  tiles: splash_blocks.SplashTiles | None = None) -> jax.Array:
    """The kernel on one device's shard: q (B, T, H, hd), k and v (B, T, KV, hd), segment_ids (B, T) or None
    -> (B, T, H, hd)."""
    B, T, H, hd = q.shape
    kernel = _splash_kernel(H, T, hd, interpret, window, softcap, tiles)
    # The kernel does not scale the logits: pre-scale the queries.
    q = (q * (1.0 / math.sqrt(hd))).transpose(0, 2, 1, 3)  # (B, H, T, hd)
    k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # (B, KV, T, hd)
    # The MHA kernel takes fewer key/value heads than query heads (H % KV == 0, query head h reads key/value
    # head h // (H // KV)), so groups need no repeated key/value heads; the MQA variant takes exactly one.
    if segment_ids is None:
        out = jax.vmap(kernel)(q, k, v)  # (B, H, T, hd): the kernel works on one example
    else:
        # The kernel ands its static causal mask with `segment q == segment kv`; every query keeps its own key.
        segmented = lambda q, k, v, ids: kernel(q, k, v, segment_ids=splash.SegmentIds(q=ids, kv=ids))  # noqa: E731
        out = jax.vmap(segmented)(q, k, v, segment_ids)  # (B, H, T, hd)
    return out.transpose(0, 2, 1, 3)  # (B, T, H, hd)


def splash_block_sizes(seq_len: int, head_dim: int,
                       tiles: splash_blocks.SplashTiles | None = None) -> splash.BlockSizes:
    """The splash kernel's blocks for sequences of seq_len: `tiles`, or by default the chip's tuned tiles
    (kernels/splash/tuned_block_sizes.py), each cut to one that divides seq_len."""
    tiles = tiles or splash_blocks.tiles_for(head_dim, seq_len)

    def fit(tile: int, within: int) -> int:
        tile = min(tile, within)
        return tile if within % tile == 0 else splash_block(within)

    q, kv = fit(tiles.block_q, seq_len), fit(tiles.block_kv, seq_len)
    kv_compute = fit(tiles.block_kv_compute, kv)
    backward = dict(block_q_dkv=q, block_kv_dkv=kv, block_kv_dkv_compute=kv_compute)
    if not tiles.fused_backward:
        backward |= dict(block_q_dq=q, block_kv_dq=kv)
    return splash.BlockSizes(block_q=q, block_kv=kv, block_kv_compute=kv_compute,
                             use_fused_bwd_kernel=tiles.fused_backward, **backward)


def _splash_kernel(heads: int, seq_len: int, head_dim: int, interpret: bool, window: int, softcap: float,
                   tiles: splash_blocks.SplashTiles | None = None):
    """A causal splash kernel for (heads, seq_len, hd) queries, within `window` positions when > 0, its logits
    soft-capped when `softcap` > 0 (the kernel caps the scaled logits, as Gemma 2 does). Made on each
    trace: its block tables become constants of that trace (the kernel's own cache keeps the NumPy mask
    processing, 0.7 s at 16k positions). Its residuals (output and log-sum-exp) carry remat's ATTN_STATS name, so
    a remat policy can keep them and the backward pass need not run the kernel's forward again."""
    if window:  # keys in [q - (window - 1), q]: causal and local in one mask
        one_head = splash.LocalMask((seq_len, seq_len), window_size=(window - 1, 0), offset=0)
    else:
        one_head = splash.CausalMask((seq_len, seq_len))
    mask = splash.MultiHeadMask([one_head] * heads)
    return splash.make_splash_mha(mask, block_sizes=splash_block_sizes(seq_len, head_dim, tiles), head_shards=1,
                                  q_seq_shards=1, interpret=interpret, attn_logits_soft_cap=softcap or None,
                                  residual_checkpoint_name=remat.ATTN_STATS)
