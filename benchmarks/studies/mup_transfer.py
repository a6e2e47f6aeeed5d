"""Width transfer of the learning rate: an AdamW learning-rate sweep at widths 128, 256 and 512, under the standard
parametrization and under muP (base width 128), on the standard-library corpus. Under muP the best learning rate
should stay put as the model widens; under the standard parametrization it should fall.

Small Llama-style models (2 layers, 4 heads whose size grows with the width, byte tokenizer), sequences of 32
tokens, batch 8, `--steps` steps with 10% warmup and cosine decay, AdamW as `optim.name=adamw` builds it (weight
decay 0.1, clipping at 1). Every learning rate of one width trains at once, `jax.vmap`ped over the sweep on the same
batches: one compilation per width and parametrization. That is exact because AdamW's update (decay included) is
linear in its learning rate: the optimizer is built with a peak rate of 1 and each member's update multiplied by
its own rate. At the base width the two parametrizations are the same model (tests/workloads/lm/test_mup.py), so
the base width is trained once. The score is the validation loss (nats/token, `--eval-batches` fixed batches) after
the last step.

    nice -n 10 python benchmarks/studies/mup_transfer.py --out mup_transfer.json --plot docs/images/mup_transfer.png
    python benchmarks/studies/mup_transfer.py --steps 2 --widths 32,64 --base 32 --log2-lrs=-9,-7 \
        --eval-batches 1 --max-bytes 200000 --out /tmp/mup.json       # the wiring in seconds (tests/test_benchmarks.py)

Prints a Markdown table; an interrupted sweep resumes from --out (run with the same arguments).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import lm_sweep  # sys.path[0]: benchmarks/studies/

SEQ_LEN, BATCH = 32, 8


def _args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--log2-lrs", default="-12,-11,-10,-9,-8,-7,-6", help="the sweep: learning rates 2^k")
    p.add_argument("--widths", default="128,256,512", help="d_model of each model, comma-separated")
    p.add_argument("--base", type=int, default=128, help="muP's base width (model.mup_base_width), one of --widths")
    p.add_argument("--eval-batches", type=int, default=16, help="validation batches of the score (default 16)")
    p.add_argument("--max-bytes", type=int, help="data.max_bytes: the corpus read (default: the recipe's)")
    p.add_argument("--out", type=Path, default=Path("mup_transfer.json"))
    p.add_argument("--plot", type=Path, help="write the sweep's plot (PNG) here")
    a = p.parse_args(argv)
    a.widths = [int(w) for w in a.widths.split(",")]
    if a.base not in a.widths:
        p.error(f"--base {a.base} is not one of --widths {a.widths}: the base width is where the two "
                "parametrizations are one model; name it in both")
    return a


def sweep(parametrization: str, width: int, lrs: list[float], a: argparse.Namespace) -> dict:
    """Final validation loss of each learning rate at one width: {"val": [...], "seconds": ...}."""
    import jax
    import jax.numpy as jnp
    import optax

    from systolic import config as config_lib
    from systolic.data import text
    from systolic.data.tokenizer import make_tokenizer
    from systolic.optim.adamw import make_schedule
    from systolic.workloads.lm.config import LMConfig
    from systolic.workloads.lm.corpus import load_corpus
    from systolic.workloads.lm.model.build import init_params, model_graphdef
    from systolic.workloads.lm.optimizer import make_lm_optimizer
    from systolic.workloads.lm.train import make_loss_fn

    steps = a.steps
    overrides = ["model.layers=2", "model.heads=4", "model.kv_heads=0", f"model.d_model={width}",
                 f"model.max_seq_len={SEQ_LEN}", f"data.seq_len={SEQ_LEN}", f"train.batch_size={BATCH}",
                 f"train.steps={steps}", f"optim.warmup_steps={steps // 10}", "optim.lr=1.0",
                 f"model.parametrization={parametrization}", f"model.mup_base_width={a.base}", "model.dtype=float32",
                 *([f"data.max_bytes={a.max_bytes}"] if a.max_bytes else [])]
    cfg, _ = config_lib.load(LMConfig, "lm-tiny", overrides, "lm-tiny", "lm")
    tokenizer = make_tokenizer(cfg.data.tokenizer)
    vocab = cfg.model.padded_vocab(tokenizer.vocab_size)
    corpus = load_corpus(cfg, tokenizer)
    train = text.make_train_iterator(corpus.train_tokens, seq_len=SEQ_LEN, global_batch=BATCH, seed=0)
    evals = text.make_eval_batches(corpus.val_tokens, seq_len=SEQ_LEN, batch=BATCH, num_batches=a.eval_batches)
    graphdef = model_graphdef(cfg.model, vocab)
    loss_fn = make_loss_fn(graphdef, cfg.model.moe, 0.0)
    # Peak rate 1 (optim.lr=1.0): each member's update is scaled by its own rate below (the module docstring).
    tx = make_lm_optimizer(cfg.optim, cfg.model, make_schedule(cfg.optim, steps))
    rates = jnp.asarray(lrs, jnp.float32)  # (R,)
    key = jax.random.PRNGKey(0)

    def one_step(params, opt_state, batch, lr):
        grads = jax.grad(lambda p: loss_fn(p, batch, key)[0])(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, jax.tree.map(lambda u: lr * u, updates)), opt_state

    step = jax.jit(jax.vmap(one_step, in_axes=(0, 0, None, 0)), donate_argnums=(0, 1))
    val_loss = jax.jit(jax.vmap(lambda p, b: loss_fn(p, b, key)[0], in_axes=(0, None)))
    start = time.perf_counter()
    params = init_params(cfg.model, vocab, jax.random.PRNGKey(cfg.train.seed))  # one init, for every rate
    params = jax.tree.map(lambda x: jnp.broadcast_to(x, (len(lrs), *x.shape)), params)  # (R, ...)
    opt_state = jax.vmap(tx.init)(params)
    for _ in range(steps):
        params, opt_state = step(params, opt_state, next(train), rates)
    losses = sum(val_loss(params, b) for b in evals) / len(evals)  # (R,)
    val = [float(x) if math.isfinite(float(x)) else math.inf for x in jax.device_get(losses)]
    return {"val": val, "seconds": time.perf_counter() - start}


def best(lrs: list[float], val: list[float]) -> float:
    return lrs[min(range(len(lrs)), key=lambda i: val[i])]


def plot(results: dict, lrs: list[float], widths: list[int], base: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, parametrization in zip(axes, ("standard", "mup")):
        for width in widths:
            val = results[key_of(parametrization, width, base)]["val"]
            ax.plot([math.log2(lr) for lr in lrs], val, marker="o", label=f"width {width}")
        ax.set_title({"standard": "standard parametrization", "mup": f"muP (base width {base})"}[parametrization])
        ax.set_xlabel("log2 learning rate (AdamW peak)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("validation loss (nats/token)")
    finite = [v for r in results.values() for v in r["val"] if math.isfinite(v)]
    axes[0].set_ylim(min(finite) - 0.05, min(max(finite), min(finite) + 1.5))
    axes[1].legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def key_of(parametrization: str, width: int, base: int) -> str:
    # At the base width the parametrizations are one model: trained once, under "standard".
    return f"{'standard' if width == base else parametrization} {width}"


def main(argv=None) -> None:
    a = _args(argv)
    lm_sweep.start_jax()
    lrs = [2.0**int(k) for k in a.log2_lrs.split(",")]
    results = json.loads(a.out.read_text()) if a.out.exists() else {}
    for parametrization in ("standard", "mup"):
        for width in a.widths:
            name = key_of(parametrization, width, a.base)
            if name not in results:
                results[name] = sweep(parametrization, width, lrs, a)
                a.out.write_text(json.dumps(results, indent=1))
                print(f"{name}: {results[name]['seconds']:.0f} s", flush=True)
    print("\n| parametrization | width | " + " | ".join(f"lr 2^{int(math.log2(lr))}" for lr in lrs) + " | best lr |")
    print("|---|---|" + "---|" * len(lrs) + "---|")
    for parametrization in ("standard", "mup"):
        for width in a.widths:
            val = results[key_of(parametrization, width, a.base)]["val"]
            cells = " | ".join(f"{v:.3f}" if math.isfinite(v) else "diverged" for v in val)
            print(f"| {parametrization} | {width} | {cells} | 2^{int(math.log2(best(lrs, val)))} |")
    if a.plot:
        plot(results, lrs, a.widths, a.base, a.plot)


if __name__ == "__main__":
    main()
