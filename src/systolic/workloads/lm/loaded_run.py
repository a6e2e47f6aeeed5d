"""A trained lm run's model, loaded: the newest intact checkpoint's parameters with the run's config and tokenizer,
on one device or laid out over a mesh. What `generate`, `serve`, `export`, `eval` and `convert to-hf` start from."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

import jax
from flax import nnx

from systolic.config import MeshConfig
from systolic.data.tokenizer import Tokenizer, make_tokenizer, run_tokenizer
from systolic.engine import finished
from systolic.errors import ConfigError, UserError
from systolic.runtime import memory
from systolic.runtime import mesh as mesh_lib
from systolic.runtime.sharding import Rules, rules_for, with_shardings
from systolic.workloads.lm.config import LMConfig
from systolic.workloads.lm.model import quant, sizes


@dataclasses.dataclass(frozen=True)
class LoadedRun:
    """A trained lm run's model: what `generate`, `export` and `eval` start from."""

    cfg: LMConfig
    tokenizer: Tokenizer  # the run's own copy (RUN_DIR/tokenizer.json), or the byte tokenizer
    vocab: int  # embedding rows (the tokenizer's vocabulary, padded)
    graphdef: nnx.GraphDef
    params: Any  # pure dict of arrays: on the first device, or laid out on `mesh` by `rules`
    step: int  # the checkpoint's step
    mesh: jax.sharding.Mesh | None = None  # None: the parameters sit on the first device
    rules: Rules | None = None
    layout: str = "one device"  # which mesh, and why: for reports
    quantized: str | None = None  # the scheme of weights stored quantized (lm/model/quant.py SCHEMES), else None

    def require_float(self, run_dir: Path, command: str, needs: str) -> None:
        """A UserError when the weights are quantized: `command` needs float weights (`needs` says why)."""
        if self.quantized is not None:
            raise UserError(f"{run_dir} holds weights quantized with the {self.quantized} scheme, but `{command}` "
                            f"needs float weights: {needs}. Fix: pass the float run (the one `systolic quantize` "
                            "read), without --quantize.")


def load_run(run_dir: Path, command: str, *, sharded: bool = False,
             devices: list[jax.Device] | None = None,
             layout: tuple[jax.sharding.Mesh, Rules] | None = None, quantize: str | None = None) -> LoadedRun:
    """The newest intact checkpoint's parameters and the run's config, with the run's own tokenizer; `command`
    ("systolic export") names what the user ran in the errors. `sharded`: the parameters laid out over `devices`
    (default: all) as `sharded_layout` chooses; `layout`: on that (mesh, rules) (the inference engine's tensor
    parallelism); otherwise on the first device. A LoRA run comes back merged: its base (from its init.from) with
    the adapters folded in, and `cfg.model.lora` off. `quantize`: a scheme of lm/model/quant.py SCHEMES, the
    weights quantized after loading and model.quant set to the scheme's; a run written by `systolic quantize`
    comes back quantized as it was saved, without `quantize`."""
    from systolic.workloads.lm.init_from import run_params
    from systolic.workloads.lm.model.lora import base_config
    from systolic.workloads.lm.model.build import model_graphdef, param_shardings

    with finished.open_run(run_dir, LMConfig, command) as run:
        cfg: LMConfig = run.cfg
        # The run's own copy of its tokenizer, not data.tokenizer's original path (relative to another folder, or gone).
        spec = run_tokenizer(run_dir, cfg.data.tokenizer)
        cfg = dataclasses.replace(cfg, model=base_config(cfg.model), data=dataclasses.replace(cfg.data, tokenizer=spec))
        tokenizer = make_tokenizer(spec)
        vocab = cfg.model.padded_vocab(tokenizer.vocab_size)
        stored = stored_scheme(run)
        count = sizes.param_count(cfg.model, vocab)  # before tracing: config.yaml may have been edited
        if layout is not None:
            devices, sharded = list(layout[0].devices.flat), True
        # A stored quantized weight takes a byte a parameter (a lower bound: norms and embeddings stay float32).
        memory.check_fits((1 if stored else 4) * count,
                          (jax.devices() if devices is None else devices) if sharded else jax.devices()[:1],
                          what=f"{run_dir}'s model ({count:,} {stored or 'float32'} parameters, from its config.yaml)",
                          fix=f"check {run_dir}/config.yaml against the run's checkpoint, or use a machine with more memory.")
        graphdef = model_graphdef(cfg.model, vocab)
        abstract = nnx.eval_shape(lambda: nnx.to_pure_dict(nnx.state(_model(cfg, vocab), nnx.Param)))
        mesh, rules, layout_text = None, None, "one device"
        if layout is not None:
            (mesh, rules), layout_text = layout, f"mesh {mesh_lib.describe(layout[0])}"
            shardings = param_shardings(cfg.model, vocab, mesh, rules)
        elif sharded:
            mesh, rules, layout_text = sharded_layout(cfg, vocab, jax.devices() if devices is None else devices)
            shardings = param_shardings(cfg.model, vocab, mesh, rules)
        else:
            shardings = jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(jax.devices()[0]), abstract)
        if stored:
            abstract = jax.eval_shape(functools.partial(quant.quantize_params, scheme=stored,
                                                        stacked=cfg.model.scan_layers), abstract)
            shardings = quant.quantized_shardings(shardings, abstract)
        params = run_params(run, with_shardings(abstract, shardings))
    if quantize is not None and stored is not None:
        raise UserError(f"{run_dir} holds weights already quantized with the {stored} scheme (written by `systolic "
                        f"quantize`), so they cannot be quantized again ({quantize}). Fix: use them as they are "
                        "(without --quantize), or quantize the float run they came from.")
    scheme = stored or quantize
    if quantize is not None and stored is None:
        params = _quantized(params, quantize, cfg.model.scan_layers, shardings)
    if scheme is not None:  # the activations as the scheme says (weight-only int8: float)
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, quant=quant.SCHEMES[scheme][1]))
        graphdef = model_graphdef(cfg.model, vocab)
    return LoadedRun(cfg=cfg, tokenizer=tokenizer, vocab=vocab, graphdef=graphdef, params=params, step=run.step,
                     mesh=mesh, rules=rules, layout=layout_text, quantized=scheme)


def stored_scheme(run: finished.FinishedRun) -> str | None:
    """The quantization scheme of an open run whose checkpoint `systolic quantize` wrote, else None."""
    scheme = run.meta().get(quant.META_KEY)
    if scheme is not None and scheme not in quant.SCHEMES:
        raise UserError(f"{run.run_dir}'s checkpoint says its weights are quantized with {scheme!r}, which this "
                        f"systolic does not know (it knows {', '.join(quant.SCHEMES)}). Fix: use the systolic version "
                        "that wrote it, or quantize the float run again.")
    return scheme


def _quantized(params: Any, scheme: str, stacked: bool, shardings: Any) -> Any:
    """The float parameters (laid out by `shardings`) quantized as `scheme` says, each where its weight lives; the
    float ones are donated."""
    fn = functools.partial(quant.quantize_params, scheme=scheme, stacked=stacked)
    out = quant.quantized_shardings(shardings, jax.eval_shape(fn, params))
    return jax.jit(fn, out_shardings=out, donate_argnums=0)(params)


def sharded_layout(cfg: LMConfig, vocab: int, devices: list[jax.Device]) -> tuple[jax.sharding.Mesh, Rules, str]:
    """The run's own mesh and sharding rules when they fit `devices` (a different count, or sizes that do not
    divide, do not; nor does a mesh that splits sequences over mesh.context, as scored texts and choices have any
    length); otherwise every device data-parallel with the parameters replicated, which fits any count.
    Returns (mesh, rules, a description for reports)."""
    from systolic.workloads.lm.model.build import param_shardings

    if cfg.mesh.context != 1:  # scoring rows and choices of any length: the sequence stays whole
        mesh = mesh_lib.make_mesh(MeshConfig(data=-1, fsdp=1, tensor=1), devices)
        return mesh, rules_for("dp", mesh), (
            f"mesh {mesh_lib.describe(mesh)} (every device data-parallel: the run split its sequences over "
            f"mesh.context={cfg.mesh.context}, which is for training)")
    try:
        mesh = mesh_lib.make_mesh(cfg.mesh, devices)
        rules = rules_for(cfg.sharding.rules, mesh)
        param_shardings(cfg.model, vocab, mesh, rules)  # a ConfigError when a dimension does not divide
        return mesh, rules, f"mesh {mesh_lib.describe(mesh)} (the run's, sharding.rules={cfg.sharding.rules})"
    except ConfigError:
        mesh = mesh_lib.make_mesh(MeshConfig(data=-1, fsdp=1, tensor=1), devices)
        m = cfg.mesh
        return mesh, rules_for("dp", mesh), (
            f"mesh {mesh_lib.describe(mesh)} (every device data-parallel: the run's mesh data={m.data} fsdp={m.fsdp} "
            f"tensor={m.tensor} does not fit these {len(devices)} device(s))")


def _model(cfg: LMConfig, vocab: int):
    from systolic.workloads.lm.model.transformer import Transformer

    return Transformer(cfg.model, vocab, rngs=nnx.Rngs(0))
