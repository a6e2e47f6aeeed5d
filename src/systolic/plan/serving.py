"""`systolic plan lm --serve`: how many users can a model serve on a slice, how fast, at what price per token?

The workload hands the planner one `ServeModel` per weight and KV-cache format: its sizes and its inference engine's
step (continuous batching's ragged batch of B decodes and a prefill chunk against the paged KV pool), lowered from
abstract inputs on a tensor-parallel mesh of the target's devices. The planner compiles it once per format (libtpu
for a TPU slice, XLA:CPU as the GPU's stand-in) and reads memory per chip (HBM over the fixed part is the KV pool,
so the sequences that fit; a compile-time out-of-memory is a result) and the collectives of the compiled HLO. The
step times are rooflines from the model's sizes, decode (HBM-bound at small batches) and prefill (compute-bound)
apart, as inference is usually reasoned about; XLA's own FLOP count is printed as a check. On a chip where the
engine was measured (targets.SERVE_CALIBRATIONS) the decode step is also priced as it ran there
(`expected_decode`), and the tokens/s and price follow it, because the roofline alone was well under the measured
step there.

`--search` compiles candidate batches until the largest that fits is found (each guess from the last compile's
fixed memory, kept between the largest batch that fitted and the smallest that did not). The readings, the
calibrated model and its accuracy on the v5e: docs/design-notes.md, this module's section.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from systolic.kernels.paged_attention import kernel as kernel_lib
from systolic.plan import hlo_collectives, hlo_text
from systolic.plan.planner import compile_lowered, ms_text
from systolic.plan.targets import PRICES_DATED, SERVE_CALIBRATIONS, Chip, Target
from systolic.runtime import memory as memory_lib
from systolic.runtime.memory import size_text

FIRST_GUESS = 0.9  # of HBM: the first batch tried fills this much with weights and KV pages (the rest: temporaries,
# which grow with the batch: sampling sorts each row's logits over the whole vocabulary)
MAX_BATCH = 1024  # sequences one decode step may hold (the engine's max_seqs); a model with room for more says so
MAX_COMPILES = 8  # per format in a --search: the guesses converge in two or three


@dataclasses.dataclass(frozen=True)
class ServeModel:
    """What a workload hands the serving planner for one weight and KV-cache format."""

    weights: str  # "bf16", "int8" (weight-only), "w8a8"
    kv: str  # the KV cache's element type, e.g. "bfloat16", "int8"
    params: int
    weight_bytes: int  # every weight once (a quantized one: values and scales)
    weight_bytes_per_chip: int  # from the weights' shardings
    weight_read_bytes_per_chip: int  # what one step reads: all but an untied embedding table (it gathers T rows)
    kv_bytes_per_token: int  # all layers, keys and values (and their scales)
    kv_formula: str  # kv_bytes_per_token written out
    kv_split: int  # devices the pool's key/value heads are split over (1: replicated on each)
    page_size: int
    matmul_flops_per_token: float  # 2 x the layers' matmul weights (not the LM head)
    head_flops_per_row: float  # 2 x d_model x vocab: the LM head, for each row's last token
    attention_flops_per_key: float  # 4 x layers x heads x head_dim: scores and mix, per token and key it sees
    window: int  # a sliding window's keys (0: none)
    window_share: float  # the share of the layers that slide (GPT-OSS, Gemma 2: half); the others see every key
    layers: int
    head_dim: int  # the key/value heads' width (the Pallas kernel's rate depends on it)
    kernel_block_keys: int  # keys the Pallas kernel reads per block (a sequence reads whole blocks)
    int8_matmuls: bool  # w8a8: int8 x int8 projections, at the chip's int8 peak
    lower_step: Callable[[int, int, int], Any]  # (decoding sequences, prefill tokens, pool pages) -> lowered step

    @property
    def kv_bytes_per_token_per_chip(self) -> float:
        return self.kv_bytes_per_token / self.kv_split

    def pages(self, tokens: int) -> int:
        return -(-tokens // self.page_size)


@dataclasses.dataclass(frozen=True)
class Compile:
    """One compiled step: a token for each of `sequences` decoding sequences and a chunk of `prefill_tokens` of a
    new prompt, with a pool of `pool_pages` (room for the sequences' context)."""

    sequences: int
    prefill_tokens: int
    pool_pages: int
    fits: bool
    peak_bytes: int  # per chip; when it does not fit, what the compiler asked for (0: its message gave no size)
    pool_bytes: int  # per chip, the program's pool
    temp_bytes: int | None
    out_of_memory: str | None
    compile_s: float
    ici_wire_bytes: float  # per chip per step, over the links (hlo_collectives: a ring)
    collectives: dict[str, int]  # kind -> count per step
    xla_flops: float | None  # all chips, each loop x its trips where the HLO shows them
    attention_kernel: bool  # the step's attention is the Pallas kernel (kernels/paged_attention/kernel.py), by its HLO


@dataclasses.dataclass(frozen=True)
class Roofline:
    step_s: float
    bound: str
    compute_s: float
    hbm_s: float
    ici_s: float
    flops: float  # the model's, all chips of a replica
    hbm_bytes_per_chip: float


@dataclasses.dataclass(frozen=True)
class Expected:
    """The decode step priced at a chip's measured serving rates (`expected_decode`): its parts, one after another."""

    step_s: float
    weights_s: float
    layers_s: float
    kv_s: float
    matmul_s: float
    ici_s: float  # the roofline's: collectives were not measured
    keys: float  # each sequence's keys read per layer (the layers' average): whole blocks of the kernel
    note: str  # what it rests on


@dataclasses.dataclass(frozen=True)
class ServePlan:
    """One format's figures on the target."""

    weights: str
    kv: str
    params: int
    weight_bytes: int
    weight_bytes_per_chip: int
    kv_bytes_per_token: int
    kv_bytes_per_token_per_chip: float
    kv_formula: str
    context: int
    sequences: int  # of `context` tokens that fit (per replica), at most MAX_BATCH
    sequences_from: str  # how that is known
    fits: bool  # at least one sequence
    step: Compile  # the compile the memory figures come from
    decode_roofline: Roofline | None  # at `sequences`
    decode_expected: Expected | None  # at the chip's measured rates (None: not measured; `unmeasured` says why)
    unmeasured: str | None
    prefill_roofline: Roofline | None
    prefill_tokens: int
    output_tokens_per_s_per_chip: float | None  # at the expected decode step where there is one, else the roofline's
    output_tokens_per_s_per_slice: float | None
    usd_per_million_output_tokens: float | None
    prefill_tokens_per_s_per_slice: float | None
    prompt_s: float | None  # prefill of a `context`-token prompt, chunk after chunk
    compiles: int


@dataclasses.dataclass(frozen=True)
class ServeReport:
    target: str
    chip: str
    chips: int
    topology: str | None
    compiler: str
    hbm_bytes: float
    tensor: int  # devices one replica spans
    replicas: int  # data-parallel copies over the slice
    price_per_chip_hour: float
    price_source: str
    plans: tuple[ServePlan, ...]


def plan_serving(model_for: Callable[[str, str], ServeModel], target: Target, *, formats: list[tuple[str, str]],
               context: int, prefill_tokens: int, tensor: int, batch: int | None, search: bool,
               price_per_chip_hour: float | None, say: Callable[[str], None] = lambda _: None) -> ServeReport:
    """Every format in `formats` ((weights, kv) pairs) planned with one replica of `tensor` devices. `batch`: plan that
    many sequences (default: as many as fit); `search`: compile until the largest batch that fits is known."""
    chip = target.chip
    price = price_per_chip_hour if price_per_chip_hour is not None else chip.price_per_chip_hour
    plans = {}
    for f in formats:
        m = model_for(*f)
        step, count, too_many = _compile_fitting(m, target, tensor, context=context, prefill_tokens=prefill_tokens,
                                                 batch=batch, search=search, say=say)
        plans[f] = _plan(m, target, tensor, step, context=context, prefill_tokens=prefill_tokens, searched=search,
                         batch=batch, too_many=too_many, price=price, compiles=count)
    source = ("--price-per-chip-hour" if price_per_chip_hour is not None
              else f"on-demand list price as of {PRICES_DATED}: {chip.source}")
    return ServeReport(target.name, chip.name, target.chips, target.topology, target.compiler, chip.hbm_bytes, tensor,
                       target.chips // tensor, price, source, tuple(plans[f] for f in formats))


def _compile_fitting(m: ServeModel, target: Target, tensor: int, *, context: int, prefill_tokens: int,
                     batch: int | None, search: bool, say: Callable[[str], None]) -> tuple[Compile, int, int | None]:
    """The step at the first batch that fits (from the first guess, or `batch`; with `search`, on to the largest
    that fits). Returns (that compile, or the last when none fits; compiles; the smallest batch seen not to fit)."""
    hbm = target.chip.hbm_bytes
    seq = m.pages(context) * m.page_size * m.kv_bytes_per_token / m.kv_split
    page = m.page_size * m.kv_bytes_per_token / m.kv_split
    n = batch or _clip(int((FIRST_GUESS * hbm - m.weight_bytes_per_chip) // seq))
    lo, hi, best, last, count = 0, None, None, None, 0  # lo: the largest batch that fitted, hi: the smallest that did not
    while count < MAX_COMPILES:
        last = _compile(m, target, tensor, n, prefill_tokens, context, say)
        count += 1
        lo, hi, best = (n, hi, last) if last.fits else (lo, n, best)
        if (best is not None and not search) or (hi is not None and hi - lo <= 1) or lo >= MAX_BATCH or (
                batch and not search):
            break
        if best is None:  # the compiler's size for a program that does not fit is no guide (see the docs): step down
            n = max(1, n * 3 // 4)
            continue
        top = MAX_BATCH if hi is None else hi - 1
        n = min(max(_capacity(best, hbm, seq, page) or 0, lo + 1), top)
    return best or last, count, hi


def _clip(n: int) -> int:
    return min(max(n, 1), MAX_BATCH)


def _compile(m: ServeModel, target: Target, tensor: int, n: int, prefill_tokens: int, context: int,
             say: Callable[[str], None]) -> Compile:
    """The step of n decoding sequences and a prefill chunk, with pages for n sequences of `context` tokens. For a
    GPU target the program holds one page a sequence: XLA:CPU, the stand-in, keeps two copies of the pool that the
    layer loop carries in its temporaries (measured: 64 MiB of pool, 127 MiB more temporaries), where the engine
    donates it to be updated in place, as libtpu does; so the full pool is added to what the small one leaves."""
    pages = n * m.pages(context) + 1  # + the null page
    compiled_pages = pages if target.chip.platform == "tpu" else n + 1
    what = f"{m.weights} weights, {m.kv} KV: {n} decoding sequences + {prefill_tokens} prompt tokens"
    say(f"  compiling {what} for {target.name} ...")  # minutes for a large model: not a hang
    lowered = m.lower_step(n, prefill_tokens, compiled_pages)
    start = time.perf_counter()
    compiled, out_of_memory = compile_lowered(lowered, target, say)
    seconds = time.perf_counter() - start
    page_bytes = m.page_size * m.kv_bytes_per_token / m.kv_split
    pool = int(pages * page_bytes)
    if compiled is None:
        needed = memory_lib.needed_bytes(out_of_memory or "")
        say(f"  compiled {what} in {seconds:.0f} s: DOES NOT FIT"
            + (f" (the compiler asks for {size_text(needed)} per chip)" if needed else ""))
        return Compile(n, prefill_tokens, pages, False, int(needed or 0), pool, None, out_of_memory, seconds, 0.0, {},
                       None, False)
    memory = compiled.memory_analysis()
    hlo = compiled.as_text()
    collectives = hlo_collectives.read_collectives(hlo, ())
    peak = memory_lib.program_bytes(memory) + int((pages - compiled_pages) * page_bytes)
    say(f"  compiled {what} in {seconds:.0f} s: {size_text(peak)} per chip")
    return Compile(n, prefill_tokens, pages, peak <= target.chip.hbm_bytes, peak, pool, int(memory.temp_size_in_bytes),
                   None, seconds, sum(c.wire_bytes for c in collectives.values()),
                   {kind: c.count for kind, c in collectives.items() if c.count},
                   hlo_text.step_cost(hlo).flops * tensor, kernel_lib.NAME in hlo)


def _capacity(c: Compile, hbm: float, seq_bytes: float, page_bytes: float) -> int | None:
    """Sequences that fit beside what compile `c` holds besides its pool and temporaries (weights, code), each with
    its pages and its share of the temporaries, which grow with the rows (sampling sorts each row's logits over the
    whole vocabulary: on llama-1b that is most of them); None when the compiler gave no size."""
    if not c.peak_bytes:
        return None
    temps = c.temp_bytes or 0
    fixed = c.peak_bytes - c.pool_bytes - temps
    return max(0, int((hbm - fixed - page_bytes) // (seq_bytes + temps / c.sequences)))


def _plan(m: ServeModel, target: Target, tensor: int, step: Compile, *, context: int, prefill_tokens: int,
          searched: bool, batch: int | None, too_many: int | None, price: float, compiles: int) -> ServePlan:
    n, how = _sequences(m, target.chip.hbm_bytes, step, context=context, searched=searched, batch=batch,
                        too_many=too_many)
    kv_chip = m.kv_bytes_per_token_per_chip
    common = dict(weights=m.weights, kv=m.kv, params=m.params,
                  weight_bytes=m.weight_bytes, weight_bytes_per_chip=m.weight_bytes_per_chip,
                  kv_bytes_per_token=m.kv_bytes_per_token, kv_bytes_per_token_per_chip=kv_chip,
                  kv_formula=m.kv_formula, context=context, sequences=n, sequences_from=how, fits=n >= 1,
                  step=step, prefill_tokens=prefill_tokens, compiles=compiles)
    if n < 1:
        return ServePlan(**common, decode_roofline=None, decode_expected=None, unmeasured=None, prefill_roofline=None,
                         output_tokens_per_s_per_chip=None, output_tokens_per_s_per_slice=None,
                         usd_per_million_output_tokens=None, prefill_tokens_per_s_per_slice=None, prompt_s=None)
    dec = decode_roofline(m, target.chip, tensor, n, context, step)
    unmeasured = _unmeasured(m, target.chip, step)
    expected = None if unmeasured else expected_decode(m, target.chip, tensor, n, context, step)
    pre = prefill_roofline(m, target.chip, tensor, prefill_tokens, step)
    replicas = target.chips // tensor
    per_slice = n / (expected or dec).step_s * replicas
    return ServePlan(**common, decode_roofline=dec, decode_expected=expected, unmeasured=unmeasured,
                     prefill_roofline=pre,
                     output_tokens_per_s_per_chip=per_slice / target.chips, output_tokens_per_s_per_slice=per_slice,
                     usd_per_million_output_tokens=price * target.chips / (per_slice * 3600) * 1e6,
                     prefill_tokens_per_s_per_slice=prefill_tokens / pre.step_s * replicas,
                     prompt_s=-(-context // prefill_tokens) * pre.step_s)


def _sequences(m: ServeModel, hbm: float, step: Compile, *, context: int, searched: bool, batch: int | None,
               too_many: int | None) -> tuple[int, str]:
    """(the sequences of `context` planned: --batch, or as many as fit beside the compiled step; how that is known)."""
    if not step.fits:
        return 0, f"the step of {step.sequences} sequence{'s' if step.sequences > 1 else ''} does not fit"
    if searched:
        n = step.sequences
        return n, f"compiled: {n} fit" + (f", {n + 1} do not" if n < MAX_BATCH else " (MAX_BATCH, the most planned)")
    kv_chip = m.kv_bytes_per_token_per_chip
    seq = m.pages(context) * m.page_size * kv_chip
    room = _capacity(step, hbm, seq, m.page_size * kv_chip) or 0
    if batch:
        return batch, f"--batch {batch}, compiled: fits; room for about {room:,}"
    return min([room, MAX_BATCH] + ([too_many - 1] if too_many else [])), (
        f"estimated from the step compiled at {step.sequences} sequences: HBM less its weights and code, over "
        f"{size_text(seq)} of pages and {size_text((step.temp_bytes or 0) / step.sequences)} of temporaries a sequence"
        + (f"; {too_many} did not compile" if too_many and too_many - 1 < room else "")
        + (f"; capped at {MAX_BATCH}" if room > MAX_BATCH else ""))


def _roofline(m: ServeModel, chip: Chip, tensor: int, flops: float, hbm_bytes: float, ici_bytes: float) -> Roofline:
    """Per chip of a replica of `tensor` chips: `flops` its model FLOPs, the bytes each chip reads and sends."""
    peak = chip.peak_int8_ops if m.int8_matmuls else chip.peak_bf16_flops
    compute_s, hbm_s, ici_s = flops / tensor / peak, hbm_bytes / chip.hbm_bytes_per_s, ici_bytes / chip.ici_bytes_per_s
    step_s = max(compute_s, hbm_s, ici_s)
    bound = {compute_s: "compute", hbm_s: "HBM", ici_s: "ICI"}[step_s]
    return Roofline(step_s, bound, compute_s, hbm_s, ici_s, flops, hbm_bytes)


def decode_roofline(m: ServeModel, chip: Chip, tensor: int, n: int, context: int, c: Compile) -> Roofline:
    """One token for each of n sequences, each at the full context (the batch's slowest step): every weight read
    once, every sequence's keys and values read once. Collectives as compiled, by their share of the step's tokens
    (the tensor-parallel reductions move each token's activations)."""
    # Keys per layer, averaged over the layers: a sliding layer's pages before its window are never read.
    keys = (1 - m.window_share) * context + m.window_share * min(context, m.window) if m.window else context
    flops = n * (m.matmul_flops_per_token + m.head_flops_per_row + m.attention_flops_per_key * keys)
    hbm_bytes = m.weight_read_bytes_per_chip + n * keys * m.kv_bytes_per_token_per_chip
    return _roofline(m, chip, tensor, flops, hbm_bytes, _decode_wire_bytes(c, n))


def _decode_wire_bytes(c: Compile, n: int) -> float:
    """Collective bytes per chip of a decode step of n tokens: the compiled step's, scaled by its token count."""
    return c.ici_wire_bytes * n / (c.sequences + c.prefill_tokens)


def _unmeasured(m: ServeModel, chip: Chip, c: Compile) -> str | None:
    """Why the decode step has no expected time on `chip` (None: it has one): only what was measured is priced."""
    if chip.name not in SERVE_CALIBRATIONS:
        return f"no serving step was measured on a {chip.name}"
    if m.weights != "bf16":
        return f"{m.weights} weights were not measured on the {chip.name} (bf16 weights were)"
    if not c.attention_kernel:
        return (f"this step's attention takes the plain path, not the Pallas kernel (MLA's latent rows or an int8 "
                f"KV pool of heads of 64: kernels/paged_attention/paged_kv.py `uses_kernel`), not measured on the "
                f"{chip.name}")
    if m.kv == "int8":
        return f"the kernel's rate over an int8 KV pool was not measured on the {chip.name} with bf16 weights"
    return None


def expected_decode(m: ServeModel, chip: Chip, tensor: int, n: int, context: int, c: Compile) -> Expected:
    """One token for each of n sequences at `context` (the batch's slowest step), at the chip's measured serving
    rates (targets.SERVE_CALIBRATIONS), one part after another, as the chip ran them: every weight at the measured
    streaming rate, and each layer's fixed cost; each sequence's keys and values at the Pallas kernel's rate, in
    the whole blocks it reads (a short sequence reads a block's rest from the null page; a sliding layer's window
    at most one block more than it spans); the matmuls of n tokens and their LM head at the measured matmul rate;
    the collectives as the roofline has them."""
    cal = SERVE_CALIBRATIONS[chip.name]
    block = m.kernel_block_keys
    full = -(-context // block) * block
    window = min(full, (-(-m.window // block) + 1) * block) if m.window else full
    keys = (1 - m.window_share) * full + m.window_share * window
    kv_rate = cal.kv_bytes_per_s if kernel_lib.splits_kv(m.head_dim) else cal.kv_bytes_per_s_narrow
    flops = n * (m.matmul_flops_per_token + m.head_flops_per_row) / tensor
    weights_s = m.weight_read_bytes_per_chip / cal.weights_bytes_per_s
    layers_s = m.layers * cal.layer_s
    kv_s = n * keys * m.kv_bytes_per_token_per_chip / kv_rate
    matmul_s = flops / cal.matmul_flops_per_s
    ici_s = _decode_wire_bytes(c, n) / chip.ici_bytes_per_s
    note = (f"weights {ms_text(weights_s)} ({m.weight_read_bytes_per_chip / 1e9:.2f} GB at "
            f"{cal.weights_bytes_per_s / 1e9:.0f} GB/s) + layers {ms_text(layers_s)} ({m.layers} x "
            f"{cal.layer_s * 1e6:.1f} us) + KV {ms_text(kv_s)} ({n} x {keys:,.0f} keys, blocks of "
            f"{block}, at the kernel's {kv_rate / 1e9:.0f} GB/s for heads of {m.head_dim}) + matmuls "
            f"{ms_text(matmul_s)} ({flops:.3e} FLOPs at {cal.matmul_flops_per_s / 1e12:.0f} TFLOP/s)"
            + (f" + ICI {ms_text(ici_s)} (the roofline's)" if ici_s else "")
            + f": the {chip.name}'s measured rates ({cal.source})")
    return Expected(weights_s + layers_s + kv_s + matmul_s + ici_s, weights_s, layers_s, kv_s, matmul_s, ici_s, keys,
                    note)


def prefill_roofline(m: ServeModel, chip: Chip, tensor: int, tokens: int, c: Compile) -> Roofline:
    """A chunk of `tokens` prompt tokens from position 0: causal attention within it (tokens x (tokens + 1) / 2
    keys), its keys and values written, the LM head for its last token."""
    causal = tokens * (tokens + 1) / 2
    windowed = sum(min(i + 1, m.window) for i in range(tokens)) if m.window else causal
    keys = (1 - m.window_share) * causal + m.window_share * windowed if m.window else causal
    flops = tokens * m.matmul_flops_per_token + m.head_flops_per_row + m.attention_flops_per_key * keys
    hbm_bytes = m.weight_read_bytes_per_chip + tokens * m.kv_bytes_per_token_per_chip
    share = tokens / (c.sequences + c.prefill_tokens)
    return _roofline(m, chip, tensor, flops, hbm_bytes, c.ici_wire_bytes * share)


def count_text(n: float) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.1f} M"


HEADER = (f"{'weights':<8} {'KV':<9} {'weights/chip':>12} {'KV B/token':>10} {'sequences':>9} "
          f"{'decode roofline':>20} {'expected':>9} {'tok/s/chip':>10} {'tok/s/slice':>11} {'$/M tok':>8} "
          f"{'prefill tok/s':>13} {'prompt':>8}")


def format_row(p: ServePlan) -> str:
    kv = p.kv
    head = f"{p.weights:<8} {kv:<9} {size_text(p.weight_bytes_per_chip):>12} {p.kv_bytes_per_token:>10,} "
    if not p.fits:
        return head + f"{0:>9} DOES NOT FIT"
    d = p.decode_roofline
    expected = ms_text(p.decode_expected.step_s) if p.decode_expected else "-"
    star = "" if p.decode_expected else "*"  # at the roofline: not comparable with an expected row
    per_chip = f"{p.output_tokens_per_s_per_chip:,.0f}{star}"
    per_slice = f"{p.output_tokens_per_s_per_slice:,.0f}{star}"
    return head + (f"{p.sequences:>9,} {ms_text(d.step_s) + ' (' + d.bound + ')':>20} {expected:>9} {per_chip:>10} "
                   f"{per_slice:>11} {f'{p.usd_per_million_output_tokens:.3g}{star}':>8} "
                   f"{p.prefill_tokens_per_s_per_slice:>13,.0f} {ms_text(p.prompt_s):>8}")


def format_report(r: ServeReport) -> str:
    first = r.plans[0]
    lines = [
        f"target        {r.target}: {r.chips} x {r.chip}" + (f" (topology {r.topology})" if r.topology else "")
        + f", {size_text(r.hbm_bytes)} HBM each",
        f"figures from  {r.compiler}: the engine's step (lm/serve/step.py) for memory and collectives; step times "
        "from the model's sizes: rooflines, and the decode step expected at the chip's measured rates where it was "
        "measured",
        f"layout        tensor parallel over {r.tensor} chip{'s' if r.tensor > 1 else ''} (Megatron: heads, MLP and "
        f"vocabulary split), {r.replicas} replica{'s' if r.replicas > 1 else ''} over the slice",
        f"model         {count_text(first.params)} parameters",
        f"context       {first.context:,} tokens a sequence; decode: one token for each sequence, each at the full "
        f"context (the slowest step); prefill: chunks of {first.prefill_tokens:,} prompt tokens",
        f"price         ${r.price_per_chip_hour:.2f} per chip-hour ({r.price_source})",
        "",
        HEADER,
        *map(format_row, r.plans),
        "",
    ]
    for p in r.plans:
        lines += _details(p)
    lines.append("sequences: of the context, per replica; expected: the decode step at the chip's measured rates "
                 "(-: not measured, see above); tok/s: output tokens of the decode step at the expected step, or "
                 "with * at the roofline (an upper bound: the v5e took 1.2 to 2.9x the roofline's step; do not "
                 "compare it with an expected row); prefill not included; $/M tok: per million output tokens at the "
                 "price above; prompt: prefill of one context-long prompt (time to first token, a lower bound)")
    return "\n".join(lines)


def _details(p: ServePlan) -> list[str]:
    kv = f"{p.weights} weights, {p.kv} KV"
    lines = [f"{kv}: weights {size_text(p.weight_bytes)} ({size_text(p.weight_bytes_per_chip)} per chip); KV "
             f"{p.kv_bytes_per_token:,} bytes a token = {p.kv_formula}, {size_text(p.kv_bytes_per_token * p.context)} "
             f"a sequence of {p.context:,}; sequences: {p.sequences:,} ({p.sequences_from})"]
    c = p.step
    what = f"step compiled at {c.sequences} decoding sequences + {c.prefill_tokens} prompt tokens"
    if p.compiles and c.fits:
        coll = ", ".join(f"{k} {v:,}" for k, v in c.collectives.items()) or "no collectives"
        lines.append(f"  {what}: {size_text(c.peak_bytes)} per chip (pool {size_text(c.pool_bytes)}, temporaries "
                     f"{size_text(c.temp_bytes or 0)}), {coll} ({size_text(c.ici_wire_bytes)} over the links), XLA "
                     f"{c.xla_flops:.3e} FLOPs; {p.compiles} compile{'s' if p.compiles > 1 else ''}, the last "
                     f"{c.compile_s:.0f} s")
    elif p.compiles:
        lines.append(f"  {what}: DOES NOT FIT" + (f", the compiler asks for {size_text(c.peak_bytes)} per chip"
                                                  if c.peak_bytes else "") + f" ({c.out_of_memory})")
    for name, r in (("decode", p.decode_roofline), ("prefill", p.prefill_roofline)):
        if r is not None:
            lines.append(f"  {name} roofline: {ms_text(r.step_s)} ({r.bound}-bound; compute {ms_text(r.compute_s)}, HBM "
                         f"{ms_text(r.hbm_s)} for {size_text(r.hbm_bytes_per_chip)} per chip, ICI {ms_text(r.ici_s)}); "
                         f"{r.flops:.3e} model FLOPs")
        if name == "decode" and r is not None and p.decode_expected:
            e = p.decode_expected
            lines.append(f"  decode expected: {ms_text(e.step_s)}, {e.step_s / r.step_s:.2f}x the roofline = {e.note}")
        elif name == "decode" and r is not None:
            lines.append(f"  decode expected: none, {p.unmeasured}: the roofline alone (tok/s an upper bound)")
    if not p.fits and c.sequences == 1:
        lines.append(f"  DOES NOT FIT: not one sequence of {p.context:,} tokens fits beside the weights "
                     f"({size_text(p.weight_bytes_per_chip)} per chip). Fix: more chips (a larger --target or "
                     "--mesh tensor), int8 weights, or a shorter --context")
    elif not p.fits:
        lines.append(f"  DOES NOT FIT at {c.sequences} sequences. Fix: a smaller --batch, or leave it out to plan "
                     "the batch that fits")
    return lines
