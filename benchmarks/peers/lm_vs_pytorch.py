"""Training throughput of the same GPT in systolic (JAX/XLA) and in PyTorch, on this machine's CPU.

Both sides train the GPT-2 block (LayerNorm, learned positions, GELU-tanh, biases, tied embeddings) with the same
sizes, batch, sequence length and optimizer (AdamW, weight decay on matrices only, global-norm clipping at 1.0),
on random byte-level tokens. Each framework runs in its own long-lived worker process (so neither one's thread
pool or compile cache disturbs the other); the parent alternates timed rounds between them, because absolute
times on a shared machine drift. Each round times `--steps` steps after the workers' warm-up (compile) steps.

    python benchmarks/peers/lm_vs_pytorch.py                      # 6 layers x 384 wide x 6 heads, seq 256, batch 8
    python benchmarks/peers/lm_vs_pytorch.py --rounds 5 --steps 10 --no-compile
    python benchmarks/peers/lm_vs_pytorch.py --json

Needs the `bench` extra (PyTorch CPU): pip install -e '.[bench]'.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

VOCAB = 320  # the byte tokenizer's 258 ids padded to a multiple of 64, as systolic does


def _args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--d-model", type=int, default=384)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=8, help="timed steps per round")
    p.add_argument("--rounds", type=int, default=4, help="alternating rounds per framework")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before the first round (compile)")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile worker")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--variant", action="append", default=[], metavar="NAME:TWEAKS[:XLA_FLAGS]",
                   help="an extra systolic worker with SYSTOLIC_CPU_TWEAKS=TWEAKS (e.g. none, flatten,attention) "
                        "and XLA_FLAGS added (`default-off`: without systolic's default XLA:CPU flags); repeat "
                        "for an ablation, e.g. --variant plain:none:default-off")
    p.add_argument("--worker", choices=["systolic", "torch", "torch-compile"], help=argparse.SUPPRESS)
    return p.parse_args(argv)


# SYSTOLIC -----------------------------------------------------------------------------------------------------


def systolic_worker(a: argparse.Namespace):
    from systolic.runtime import cpu_tuning

    cpu_tuning.apply_at_start(workload="lm", stepping=True)  # as `systolic train lm` does, before jax starts
    import jax
    import numpy as np

    from systolic.config import MeshConfig
    from systolic.data.tokenizer import ByteTokenizer
    from systolic.runtime import mesh as mesh_lib
    from systolic.runtime.sharding import activate
    from systolic.workloads.lm.config import DataConfig, LMConfig, LMOptimConfig, LMTrainConfig
    from systolic.workloads.lm.model.config import ModelConfig
    from systolic.workloads.lm.train import build_step

    cfg = LMConfig(
        model=ModelConfig(family="gpt2", d_model=a.d_model, layers=a.layers, heads=a.heads, max_seq_len=a.seq,
                          tie_embeddings=True, dtype="float32"),
        data=DataConfig(seq_len=a.seq),
        train=LMTrainConfig(batch_size=a.batch, steps=1000),
        optim=LMOptimConfig(lr=3e-4, warmup_steps=0),
        mesh=MeshConfig(),
    )
    mesh = mesh_lib.make_mesh(cfg.mesh)
    step = build_step(cfg, mesh, ByteTokenizer())
    assert step.vocab == VOCAB, step.vocab
    rng = np.random.default_rng(0)
    with activate(mesh, step.rules):
        state = step.init()
        params = sum(x.size for x in jax.tree.leaves(state.params))

        def batch():
            tok = rng.integers(0, 258, (a.batch, a.seq + 1), dtype=np.int32)
            return jax.device_put({"inputs": tok[:, :-1], "targets": tok[:, 1:]}, step.batch_sharding)

        def run(n: int):
            nonlocal state
            batches = [batch() for _ in range(n)]
            t = time.perf_counter()
            for b in batches:
                state, metrics = step.train_step(state, b)
            jax.block_until_ready(state)
            return time.perf_counter() - t, float(metrics["loss"])

        yield params, run


# PYTORCH ------------------------------------------------------------------------------------------------------


def torch_worker(a: argparse.Namespace, compiled: bool):
    import torch
    import torch.nn.functional as F
    from torch import nn

    torch.manual_seed(0)
    torch.set_num_threads(os.cpu_count() or 1)

    class Block(nn.Module):
        def __init__(self, d: int, h: int):
            super().__init__()
            self.h = h
            self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.c_fc, self.mlp_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x):  # (B, T, D)
            B, T, D = x.shape
            q, k, v = self.c_attn(self.ln_1(x)).split(D, dim=2)
            q, k, v = (t.view(B, T, self.h, D // self.h).transpose(1, 2) for t in (q, k, v))  # (B, H, T, hd)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, D)
            x = x + self.c_proj(y)
            return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(VOCAB, a.d_model), nn.Embedding(a.seq, a.d_model)
            self.blocks = nn.ModuleList(Block(a.d_model, a.heads) for _ in range(a.layers))
            self.ln_f = nn.LayerNorm(a.d_model)
            for p in self.parameters():
                if p.dim() >= 2:
                    nn.init.normal_(p, std=0.02)

        def forward(self, idx):  # (B, T) -> (B, T, V)
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
            for block in self.blocks:
                x = block(x)
            return self.ln_f(x) @ self.wte.weight.T

    model = GPT()
    params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=3e-4, betas=(0.9, 0.95), eps=1e-8)

    def train_step(inputs, targets):
        logits = model(inputs)
        loss = F.cross_entropy(logits.view(-1, VOCAB), targets.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss

    if compiled:
        model = torch.compile(model)
    gen = torch.Generator().manual_seed(0)

    def run(n: int):
        batches = [torch.randint(0, 258, (a.batch, a.seq + 1), generator=gen) for _ in range(n)]
        t = time.perf_counter()
        for tok in batches:
            loss = train_step(tok[:, :-1], tok[:, 1:])
        value = float(loss.detach())
        return time.perf_counter() - t, value

    yield params, run


# THE DRIVER ---------------------------------------------------------------------------------------------------


def worker_main(a: argparse.Namespace) -> None:
    gen = systolic_worker(a) if a.worker == "systolic" else torch_worker(a, a.worker == "torch-compile")
    t = time.perf_counter()
    params, run = next(gen)
    run(a.warmup)
    print(json.dumps({"params": params, "setup_s": time.perf_counter() - t}), flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            break
        seconds, loss = run(a.steps)
        peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
        print(json.dumps({"seconds": seconds, "loss": loss, "peak_rss_mb": peak_mb}), flush=True)


def _start(name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, __file__, *argv, "--worker", name], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, bufsize=1, env=env)


def _variant_env(spec: str) -> tuple[str, dict[str, str]]:
    name, _, rest = spec.partition(":")
    tweaks, _, flags = rest.partition(":")
    env = dict(os.environ, SYSTOLIC_CPU_TWEAKS=tweaks or "all")
    if flags == "default-off":  # without systolic's default XLA:CPU flags (systolic/runtime/cpu_tuning.py)
        env["SYSTOLIC_XLA_CPU_FLAGS"] = "off"
    elif flags:
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + flags).strip()
    return name, env


def _ask(proc: subprocess.Popen, message: str | None) -> dict | None:
    if message is not None:
        proc.stdin.write(message + "\n")
        proc.stdin.flush()
    line = proc.stdout.readline()
    return json.loads(line) if line else None


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    if a.worker:
        worker_main(a)
        return 0
    try:
        import torch  # noqa: F401
    except ImportError:
        print("PyTorch is not installed. Fix: pip install -e '.[bench]' (PyTorch CPU), then run this again.",
              file=sys.stderr)
        return 2
    passthrough = [f"--layers={a.layers}", f"--d-model={a.d_model}", f"--heads={a.heads}", f"--seq={a.seq}",
                   f"--batch={a.batch}", f"--steps={a.steps}", f"--warmup={a.warmup}"]
    plan = [("systolic", "systolic", None)] + [("systolic", *_variant_env(v)) for v in a.variant]
    plan += [("torch", "torch", None)] + ([] if a.no_compile else [("torch-compile", "torch-compile", None)])
    workers, info = {}, {}
    for kind, name, env in plan:  # one at a time: compiles do not overlap
        proc = _start(kind, passthrough, env)
        hello = _ask(proc, None)
        if hello is None:
            print(f"{name}: the worker failed to start (see its error above); leaving it out.", file=sys.stderr)
            continue
        workers[name], info[name] = proc, hello
    tokens = a.batch * a.seq * a.steps
    rates: dict[str, list[float]] = {n: [] for n in workers}
    for _ in range(a.rounds):
        for name, proc in workers.items():
            reply = _ask(proc, "run")
            if reply is None:
                print(f"{name}: the worker died mid-run; leaving it out.", file=sys.stderr)
                continue
            rates[name].append(tokens / reply["seconds"])
            info[name]["peak_rss_mb"] = reply["peak_rss_mb"]
    for proc in workers.values():
        proc.stdin.close()
        proc.wait()
    result = {
        "config": {"layers": a.layers, "d_model": a.d_model, "heads": a.heads, "seq": a.seq, "batch": a.batch,
                   "steps_per_round": a.steps, "rounds": a.rounds, "cpus": os.cpu_count()},
        "frameworks": {n: {"params": info[n]["params"], "setup_s": info[n]["setup_s"],
                           "tokens_per_s": statistics.median(r), "rounds": r,
                           "peak_rss_mb": info[n]["peak_rss_mb"]} for n, r in rates.items() if r},
    }
    base = result["frameworks"].get("torch", {}).get("tokens_per_s")
    for n, f in result["frameworks"].items():
        f["vs_torch_eager"] = f["tokens_per_s"] / base if base else None
    if a.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"GPT-2 block, {a.layers} layers x {a.d_model} wide x {a.heads} heads, seq {a.seq}, batch {a.batch}, "
          f"{os.cpu_count()} CPUs; median of {a.rounds} alternating rounds of {a.steps} steps")
    print(f"{'framework':<15} {'params':>11} {'setup s':>8} {'peak RSS MB':>12} {'tokens/s':>10} {'vs torch eager':>15}")
    for n, f in result["frameworks"].items():
        ratio = f"{f['vs_torch_eager']:.2f}x" if f["vs_torch_eager"] else "n/a"
        print(f"{n:<15} {f['params']:>11,} {f['setup_s']:>8.1f} {f['peak_rss_mb']:>12,.0f} {f['tokens_per_s']:>10,.0f} "
              f"{ratio:>15}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
