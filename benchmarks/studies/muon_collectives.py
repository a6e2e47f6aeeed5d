"""What Muon costs on a mesh: the collectives of the compiled lm train step (AdamW, our Muon, Optax's Muon) on 8 fake
CPU devices, read from the optimised HLO (plan/hlo_collectives.py), per step and per device.

The model is a small Llama (d_model 32, 2 layers, 4 query heads sharing 2 key/value heads, MLP 128: the tests'
TINY_LM); "hidden matrices" are the weights Muon moves (attention q, k, v, o and the MLP's three). Optax's Muon is
`optax.contrib.scale_by_muon` with the same fan-in/fan-out axes, in place of ours inside the same optimizer.

    python benchmarks/studies/muon_collectives.py                    # the three meshes of docs/optimizers.md
    python benchmarks/studies/muon_collectives.py --meshes fsdp=8      # one

Prints a Markdown table. Compiles only (nothing runs): about a minute.
"""

from __future__ import annotations

import argparse
import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

MODEL = ["model.d_model=32", "model.layers=2", "model.heads=4", "model.kv_heads=2", "model.max_seq_len=32",
         "data.seq_len=16", "train.batch_size=8", "train.steps=10"]
MESHES = ("fsdp=4,tensor=2", "fsdp=8", "data=2,fsdp=2,tensor=2")


def optax_muon(cfg):
    """Optax's Muon transform (`optax.contrib.scale_by_muon`) on our hidden matrices' fan-in and fan-out axes: what
    `make_lm_optimizer(..., muon_transform=)` puts in place of ours (optim/muon.py), the rest of the optimizer
    unchanged."""
    import jax
    from optax.contrib import MuonDimensionNumbers, scale_by_muon

    from systolic.optim import muon
    from systolic.workloads.lm.model.parametrization import MUON_AXES, role

    def dims(tree):
        def one(path, _):
            if role(path) != "hidden":
                return None
            fan_in, fan_out = MUON_AXES[str(getattr(path[-1], "key", path[-1]))]
            return MuonDimensionNumbers(fan_in, fan_out)

        return jax.tree_util.tree_map_with_path(one, tree)

    return scale_by_muon(muon.NS_COEFFS, muon.NS_STEPS, beta=cfg.optim.muon_momentum, weight_dimension_numbers=dims)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--meshes", nargs="+", default=list(MESHES), metavar="AXIS=N,...",
                        help="the meshes (unnamed axes 1; default: the three of docs/optimizers.md)")
    args = parser.parse_args(argv)
    import jax

    from systolic import config as config_lib
    from systolic.config import MeshConfig
    from systolic.data.tokenizer import ByteTokenizer
    from systolic.optim.adamw import make_schedule
    from systolic.plan.hlo_collectives import read_collectives
    from systolic.runtime import mesh as mesh_lib
    from systolic.runtime.sharding import activate
    from systolic.workloads.lm import train
    from systolic.workloads.lm.config import LMConfig
    from systolic.workloads.lm.model.parametrization import role
    from systolic.workloads.lm.optimizer import make_lm_optimizer

    print("| mesh | optimizer | all-gather (count, KB) | all-reduce (count, KB) | other | "
          "all-gather KB beyond AdamW's / hidden matrices' KB |")
    print("|---|---|---|---|---|---|")
    for text in args.meshes:
        axes = {"data": 1, "fsdp": 1, "tensor": 1} | {k: int(v) for k, v in (a.split("=") for a in text.split(","))}
        mesh = mesh_lib.make_mesh(MeshConfig(**axes), jax.devices()[:8])
        base = None
        for label, name, theirs in (("AdamW", "adamw", False), ("Muon (ours)", "muon", False),
                                    ("Muon (optax.contrib)", "muon", True)):
            cfg = config_lib.from_dict(LMConfig, config_lib.apply_overrides({}, [*MODEL, f"optim.name={name}"]))
            # None: build_step's own optimizer; else ours with Optax's Muon transform in place of ours.
            tx = make_lm_optimizer(cfg.optim, cfg.model, make_schedule(cfg.optim, cfg.train.steps),
                                   muon_transform=optax_muon(cfg)) if theirs else None
            step = train.build_step(cfg, mesh, ByteTokenizer(), tx=tx)
            with activate(mesh, step.rules):
                hlo = step.train_step.lower(step.abstract, train.abstract_batch(cfg, step.batch_sharding)
                                            ).compile().as_text()
            c = read_collectives(hlo)
            flat = jax.tree_util.tree_flatten_with_path(step.abstract.params)[0]
            hidden_kb = sum(4 * x.size for path, x in flat if role(path) == "hidden") / 1e3
            gather, reduce = c["all-gather"], c["all-reduce"]
            other = ", ".join(f"{k} {v.count} ({v.bytes / 1e3:.1f} KB)" for k, v in c.items()
                              if v.count and k not in ("all-gather", "all-reduce")) or "-"
            base = base or gather.bytes
            extra = (gather.bytes - base) / 1e3
            mesh_text = ", ".join(f"{k}={v}" for k, v in axes.items() if v > 1)
            print(f"| {mesh_text} | {label} | {gather.count}, {gather.bytes / 1e3:.1f} | {reduce.count}, "
                  f"{reduce.bytes / 1e3:.1f} | {other} | {extra:.1f} / {hidden_kb:.1f} = {extra / hidden_kb:.2f}x |",
                  flush=True)


if __name__ == "__main__":
    main()
