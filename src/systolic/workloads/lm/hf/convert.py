"""Hugging Face weights <-> lm run directories, for Llama (incl. grouped-query attention and Llama 3.1+ RoPE
scaling), Qwen2/2.5, Qwen3, Mistral and GPT-2 (`hf_config` lists what each brings).

`systolic convert from-hf SRC RUN_DIR` reads a local folder (config.json + model.safetensors, or sharded
model-*.safetensors + model.safetensors.index.json) one tensor at a time, places each parameter straight into
its sharded layout, and writes a run directory: config.yaml, tokenizer.json (when SRC has one, with its special
tokens, chat template and the model's generation settings: `data.tokenizer.COMPANION_FILES`,
`data.generation_config`) and a parameters-only checkpoint at step 0, which
`systolic generate` and `systolic train lm init.from=RUN_DIR` read.
`systolic convert to-hf RUN_DIR OUT` writes the latest checkpoint back as a folder `from_pretrained` loads.
Which tensor is which lives in `hf_tensors`, config.json in `hf_config`; tests/workloads/lm/test_hf.py and
test_hf_families.py check logits and greedy generations against transformers.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from systolic import config as config_lib
from systolic import outfile
from systolic.observe.heartbeat import heartbeat
from systolic.config import MeshConfig
from systolic.data import generation_config
from systolic.data.tokenizer import RUN_FILE, make_tokenizer, tokenizer_files
from systolic.data.chat import find_chat_template
from systolic.engine import rundir
from systolic.engine.checkpoint import Checkpointer
from systolic.engine.state import TrainState
from systolic.errors import ConfigError, UserError
from systolic.runtime import mesh as mesh_lib
from systolic.runtime.sharding import rules_for
from systolic.runtime import memory
from systolic.workloads.lm.hf import config as hf_config
from systolic.workloads.lm.model import parametrization
from systolic.workloads.lm.hf import mxfp4, safetensors_file
from systolic.workloads.lm.model import sizes
from systolic.workloads.lm.config import DataConfig, LMConfig
from systolic.workloads.lm.model.config import ModelConfig
from systolic.workloads.lm.hf.tensors import KeyPath, Pair, group_by, hf_shape, join, pairs, part_shape, to_hf, to_ours
from systolic.workloads.lm.model.transformer import Transformer
from systolic.workloads.lm.loaded_run import load_run
from systolic.workloads.lm.model.build import param_shardings


def abstract_params(cfg: ModelConfig, vocab: int) -> dict[str, Any]:
    """Our parameters as a pure dict of ShapeDtypeStructs (no allocation)."""
    return nnx.eval_shape(lambda: nnx.to_pure_dict(nnx.state(Transformer(cfg, vocab, rngs=nnx.Rngs(0)), nnx.Param)))


# READING A HUGGING FACE FOLDER --------------------------------------------------------------------------------


class Folder:
    """The safetensors tensors of a Hugging Face folder: headers read up front, data one tensor at a time."""

    IGNORED = re.compile(r"(\.attn\.bias|\.attn\.masked_bias|rotary_emb\.inv_freq)$")  # buffers, not weights

    def __init__(self, src: Path):
        self.src = Path(src)
        index = self.src / "model.safetensors.index.json"
        if index.is_file():
            files = [self.src / f for f in safetensors_file.read_index(index)]  # not stray files like consolidated.safetensors
        elif (self.src / "model.safetensors").is_file():
            files = [self.src / "model.safetensors"]
        else:
            files = sorted(p for p in self.src.glob("*.safetensors") if p.is_file())
        if not files:
            raise UserError(
                f"{self.src} has no *.safetensors weights. Expected model.safetensors, or model-*.safetensors with "
                "model.safetensors.index.json. Fix: download the safetensors version of the model, or convert a "
                "pytorch_model.bin with transformers: `AutoModelForCausalLM.from_pretrained(src).save_pretrained(dir)`."
            )
        self.where: dict[str, Path] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, str] = {}
        for path in files:
            if not path.is_file():
                raise UserError(f"{index} lists {path.name}, which is missing. Fix: download the complete model.")
            for name, info in safetensors_file.read_header(path).items():
                self.where[name] = path
                self.shapes[name], self.dtypes[name] = info.shape, info.dtype
        # MXFP4 tensors (GPT-OSS's experts, quantization_config.quant_method mxfp4): the blocks and scales stand
        # for one float tensor of the dequantized shape, made when it is read.
        self.mxfp4: dict[str, tuple[str, str]] = {}
        config = hf_config.read_config(self.src) if (self.src / "config.json").is_file() else {}
        if hf_config.quant_method(config, self.src) == "mxfp4":
            for name in [n for n in self.where if n.endswith("_blocks")]:
                base = name.removesuffix("_blocks")
                blocks, scales = mxfp4.quantized_names(base)
                if scales in self.where and self.dtypes[blocks] == self.dtypes[scales] == "U8":
                    self.mxfp4[base] = (blocks, scales)
                    self.where[base], self.shapes[base] = self.where[blocks], mxfp4.dequantized_shape(self.shapes[blocks])
                    self.dtypes[base] = "F32"
                    for part in (blocks, scales):
                        del self.where[part], self.shapes[part], self.dtypes[part]
        self._last: tuple[str, np.ndarray] | None = None
        # One open handle per file: opening parses the file's whole header, so opening it again for each tensor
        # costs O(tensors^2) over a model (1,024 layers: 9,219 tensors in one file, minutes).
        self._files: dict[Path, Any] = {}

    def resolve(self, name: str) -> str | None:
        """The stored name of `name`: checkpoints saved from the bare model (GPT2Model, as the original gpt2
        weights are) lack the `model.`/`transformer.` prefix."""
        if name in self.where:
            return name
        bare = name.split(".", 1)[1] if name.startswith(("model.", "transformer.")) else None
        return bare if bare in self.where else None

    def read(self, name: str) -> np.ndarray:
        if self._last is None or self._last[0] != name:  # GPT-2's c_attn is read once for q, k and v
            try:
                path = self.where[name]
                if path not in self._files:
                    self._files[path] = safe_open(path, framework="numpy")
                f = self._files[path]
                if name in self.mxfp4:
                    tensor = mxfp4.dequantize(*(f.get_tensor(part) for part in self.mxfp4[name]))
                else:
                    tensor = f.get_tensor(name)
            except (SafetensorError, OSError, ValueError) as e:
                raise UserError(f"{self.where[name]}: could not read tensor {name} ({e}). Expected a complete "
                                "safetensors file. Fix: download the file again.") from None
            finite = np.isfinite(tensor)
            if not finite.all():
                raise UserError(
                    f"{self.where[name]}: tensor {name} holds {finite.size - int(finite.sum()):,} NaN or infinite "
                    f"values of {finite.size:,}. Trained weights are finite; these would make every output NaN. "
                    "Fix: download the file again, or use a checkpoint saved before training diverged."
                )
            self._last = (name, tensor)
        return self._last[1]

    def mtp_tensors(self, cfg: ModelConfig) -> list[str]:
        """DeepSeek-V3's multi-token-prediction modules, stored as layers after the decoder's (model.layers.{L}...):
        they serve speculative decoding only, and are not imported."""
        if not cfg.mla.kv_lora_rank:
            return []
        layer = re.compile(r"model\.layers\.(\d+)\.")
        return [n for n in self.where if (m := layer.match(n)) and int(m.group(1)) >= cfg.layers]

    def check(self, cfg: ModelConfig, expected: list[Pair], shapes: dict[KeyPath, tuple[int, ...]]) -> dict[str, str]:
        """Maps each expected name to its stored name; a missing, unknown or misshapen tensor is a UserError."""
        stored = {p.hf: self.resolve(p.hf) for p in expected}
        missing = [name for name, found in stored.items() if found is None]
        if missing:
            templates = sorted({re.sub(r"\.\d+\.", ".{i}.", p.hf) for p in expected})
            raise UserError(
                f"{self.src} lacks {len(missing)} tensor(s) that a {cfg.family} model with this config.json needs: "
                f"{_some(missing)}. Expected tensors (i = 0..{cfg.layers - 1}): "
                f"{', '.join(templates)}. Fix: download the complete checkpoint, or check that config.json (layers, "
                "tie_word_embeddings) belongs to these weights."
            )
        integer = {n: self.dtypes[n] for n in stored.values() if self.dtypes[n] not in safetensors_file.FLOAT_DTYPES}
        if integer:
            raise UserError(
                f"{self.src} holds weights that are not floating point: {_some([f'{n} ({d})' for n, d in integer.items()])}. "
                "systolic converts float checkpoints (F32, F16, BF16); integer or float8 weights come from a "
                "quantization scheme whose scales it does not apply. Fix: pass the unquantized checkpoint."
            )
        used = set(stored.values()) | set(self.mtp_tensors(cfg))
        unknown = [n for n in self.where if n not in used and not self.IGNORED.search(n)
                   and not (cfg.tie_embeddings and n.endswith("lm_head.weight"))]
        if unknown:
            raise UserError(
                f"{self.src} holds tensors that a {cfg.family} model as described by config.json does not have: "
                f"{_some(unknown)}. They may belong to a variant systolic does not convert (e.g. biases that "
                "config.json does not announce); importing without them would change the model. Fix: check that "
                "config.json belongs to these weights, or pass a checkpoint of a supported architecture."
            )
        for name, group in group_by(expected, lambda p: p.hf).items():
            want = hf_shape(group, part_shape(shapes[group[0].path], group[0]))
            if self.shapes[stored[name]] != want:
                raise UserError(
                    f"{self.src}: tensor {stored[name]} has shape {self.shapes[stored[name]]}, but config.json implies "
                    f"{want}. Fix: check that config.json belongs to these weights."
                )
        return stored


def load_params(src: Path, cfg: ModelConfig, shardings: Any) -> dict[str, Any]:
    """Our parameters (pure dict, float32) from the HF folder `src`, each placed directly on its NamedSharding in
    `shardings` (as `lm.model.build.param_shardings` gives them). Only one parameter (one HF tensor per layer when
    stacked) is on the host at a time, and each device receives only its own slice."""
    folder = Folder(src)
    vocab = cfg.padded_vocab(0)
    flat_shapes = jax.tree_util.tree_flatten_with_path(abstract_params(cfg, vocab))[0]
    shapes = {tuple(k.key for k in path): x.shape for path, x in flat_shapes}
    expected = pairs(cfg, str(hf_config.read_config(src).get("model_type")))  # the folder's tensor names (Phi-3's fused)
    stored = folder.check(cfg, expected, shapes)
    groups = group_by(expected, lambda p: p.path)
    flat, treedef = jax.tree_util.tree_flatten_with_path(shardings)
    leaves = []
    for key_path, sharding in flat:
        path = tuple(k.key for k in key_path)
        group = groups[path]
        host = np.empty(shapes[path], np.float32)  # (L, E, ...) of stacked experts: one HF tensor per (layer, expert)
        for p in group:
            host[p.index] = to_ours(p.tensor, folder.read(stored[p.hf]), part_shape(shapes[path], p))
        leaves.append(jax.make_array_from_callback(host.shape, sharding, lambda index, host=host: host[index]))
        del host
    return jax.tree_util.tree_unflatten(treedef, leaves)


# WRITING A HUGGING FACE FOLDER --------------------------------------------------------------------------------


Export = list[tuple[str, tuple[int, ...], Callable[[], np.ndarray]]]  # (HF name, shape, function making it)


def export_tensors(cfg: ModelConfig, params: dict[str, Any], model_type: str = "") -> Export:
    """Every HF tensor of host params (pure dict of NumPy arrays), each built only when its function is called;
    `model_type`: the architecture written (hf_tensors.pairs: Phi-3's fused tensors)."""

    def at(path: KeyPath) -> np.ndarray:
        x = params
        for key in path:
            x = x[key]
        return x

    def part(p: Pair) -> np.ndarray:
        x = at(p.path)
        return to_hf(p.tensor, np.asarray(x[p.index]))

    out = []
    for name, group in group_by(pairs(cfg, model_type), lambda p: p.hf).items():
        group = sorted(group, key=lambda p: p.tensor.part[0])  # GPT-2's c_attn, Phi-3's qkv_proj: q, k, v in order
        make = (lambda group=group: np.ascontiguousarray(join(group[0].tensor, [part(p) for p in group])))
        out.append((name, hf_shape(group, part_shape(at(group[0].path).shape, group[0])), make))
    return out


def write_safetensors(out: Path, tensors: Export, max_shard_bytes: int) -> list[str]:
    """model.safetensors, or model-0000k-of-0000n.safetensors plus model.safetensors.index.json when the float32
    tensors exceed `max_shard_bytes` (a tensor larger than that gets a shard of its own). Returns the files' names."""
    shards: list[list[int]] = [[]]
    size = 0
    for i, (_, shape, _) in enumerate(tensors):
        nbytes = 4 * math.prod(shape)
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(i)
        size += nbytes
    n = len(shards)
    names = ["model.safetensors"] if n == 1 else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
    weight_map = {}
    for file, shard in zip(names, shards):
        # Built one shard at a time: the host holds at most one shard of HF tensors besides the parameters.
        arrays = {tensors[i][0]: tensors[i][2]().astype(np.float32) for i in shard}
        save_file(arrays, str(out / file), metadata={"format": "pt"})  # transformers requires the format key
        weight_map.update({tensors[i][0]: file for i in shard})
    if n > 1:
        total = sum(4 * math.prod(shape) for _, shape, _ in tensors)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2), encoding="utf-8")
        names.append("model.safetensors.index.json")
    return names


def parse_size(text: str) -> int:
    """Bytes in '5GB', '500MB', '200KiB' or '1000000' (KB/MB/GB are powers of 1000, KiB/MiB/GiB of 1024)."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).upper() not in units or float(match.group(1)) <= 0:
        raise UserError(f"--max-shard-size {text!r} is not a size. Expected a positive number with an optional unit "
                        "(B, KB, MB, GB, KiB, MiB, GiB), e.g. 5GB or 500MB.")
    return int(float(match.group(1)) * units[match.group(2).upper()])


# RUN DIRECTORIES ----------------------------------------------------------------------------------------------


def import_run(src: Path, run_dir: Path, *, scan_layers: bool = False,
               say: Callable[[str], None] = print) -> LMConfig:
    """`systolic convert from-hf`: writes `run_dir` (config.yaml, tokenizer.json and its companions, a step-0
    parameters-only checkpoint). The directory appears complete or not at all. Returns the run's config; `say`
    prints what the import leaves out (DeepSeek's multi-token-prediction layers)."""
    src, run_dir = Path(src), Path(run_dir)
    hf = hf_config.read_config(src)
    mcfg = hf_config.model_config(hf, src, scan_layers=scan_layers)
    token_ids = generation_config.imported(src, hf, mcfg.vocab_size)  # checked before the slow part
    params = sizes.param_count(mcfg, mcfg.vocab_size)
    memory.check_fits(4 * params, jax.devices(), what=f"{src}/config.json's model ({params:,} float32 parameters)",
                      fix="convert a smaller model, or check that config.json's sizes are the model's.")
    _check_free(run_dir)
    tokenizer = src / RUN_FILE
    # Without a tokenizer.json the run uses bytes: right for a model that systolic trained and exported.
    made = make_tokenizer(str(tokenizer) if tokenizer.is_file() else "byte")
    find_chat_template(made)  # a template over its budget is refused before anything is written
    ids = made.vocab_size
    if ids > mcfg.vocab_size:
        which = f"its {RUN_FILE}" if tokenizer.is_file() else f"the byte tokenizer (there is no {RUN_FILE})"
        raise UserError(
            f"{src}: {which} has {ids} ids, but the model has only {mcfg.vocab_size} embedding rows. Fix: put the "
            f"model's own {RUN_FILE} into {src}."
        )
    data = {"tokenizer": str((run_dir / RUN_FILE).absolute()) if tokenizer.is_file() else "byte",
            "seq_len": min(DataConfig.seq_len, mcfg.max_seq_len)}
    cfg = config_lib.from_dict(LMConfig, {"workload": "lm", "model": config_lib.to_dict(mcfg), "data": data})
    with heartbeat(say, f"import: reading {src}'s weights"):  # a large model's files take minutes
        params = load_params(src, mcfg, _host_shardings(mcfg))
    if dropped := Folder(src).mtp_tensors(mcfg):
        say(f"note: {src}'s {len(dropped)} multi-token-prediction tensors (layers from {mcfg.layers} on, "
            "num_nextn_predict_layers) are not imported: they serve speculative decoding, which systolic does not run; "
            "the model's own next-token predictions are unchanged.")
    tmp = run_dir.with_name(f".{run_dir.name}.converting-{os.getpid()}")
    try:
        tmp.mkdir(parents=True)
        (tmp / rundir.CONFIG_FILE).write_text(config_lib.dump_yaml(cfg), encoding="utf-8")
        if tokenizer.is_file():
            for name, path in tokenizer_files(tokenizer).items():
                shutil.copyfile(path, tmp / name)
            # A companion of the tokenizer, so it travels with it into a fine-tune (without one, nothing travels).
            (tmp / generation_config.MODEL_IDS_FILE).write_text(json.dumps(token_ids, indent=2), encoding="utf-8")
        ckpt = Checkpointer(tmp / "checkpoints", cfg.checkpoint)
        state = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state={}, rng=jax.random.PRNGKey(0))
        meta = {"workload": "lm", "vocab": mcfg.vocab_size, "params_only": True, "source": str(src.absolute())}
        with heartbeat(say, f"import: writing the checkpoint of {run_dir}"):
            ckpt.save(state, None, meta)
            ckpt.wait()
        ckpt.close()
        os.replace(tmp, run_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return cfg


def export_run(run_dir: Path, out: Path, *, max_shard_bytes: int = 5 * 10**9) -> list[str]:
    """`systolic convert to-hf`: the run's newest intact checkpoint as a Hugging Face folder (config.json,
    generation_config.json, safetensors, tokenizer.json and its companions when the run has one), written to a
    temporary folder and renamed when complete.
    Returns the names of the files written."""
    out = Path(out)
    _check_free(out)
    run = load_run(Path(run_dir), "systolic convert to-hf")
    run.require_float(Path(run_dir), "systolic convert to-hf", "Hugging Face folders hold float weights")
    # The ids the run keeps beside its own tokenizer (an import's), else those the tokenizer defines.
    template = find_chat_template(run.tokenizer)
    ids, generation = generation_config.exported(run.tokenizer, None if template is None else template.stop_ids)
    hf = hf_config.hf_config(run.cfg.model, run.vocab, ids)
    params = parametrization.to_standard(run.cfg.model, jax.device_get(run.params))  # muP's multipliers folded in
    tmp = out.with_name(f".{out.name}.converting-{os.getpid()}")
    try:
        tmp.mkdir(parents=True)
        (tmp / "config.json").write_text(json.dumps(hf, indent=2), encoding="utf-8")
        tensors = export_tensors(run.cfg.model, params, hf["model_type"])
        files = write_safetensors(tmp, tensors, max_shard_bytes)
        if generation is not None:  # else the run's own copy, among the tokenizer's files
            (tmp / generation_config.GENERATION_FILE).write_text(json.dumps(generation, indent=2), encoding="utf-8")
            files.append(generation_config.GENERATION_FILE)
        if run.cfg.data.tokenizer != "byte":  # the run's own copy, with the chat template that travelled with it
            for name, path in tokenizer_files(Path(run.cfg.data.tokenizer)).items():
                if name != generation_config.MODEL_IDS_FILE:  # its ids are config.json's, written above
                    shutil.copyfile(path, tmp / name)
                    files.append(name)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return ["config.json", *files]


def _some(names: list[str], limit: int = 20) -> str:
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _check_free(path: Path) -> None:
    outfile.check_folder(path, option="the output folder")
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise UserError(f"{path} already exists and is not empty; conversion never overwrites. Fix: pass a new "
                        "directory, or remove this one first.")


def _host_shardings(cfg: ModelConfig) -> Any:
    """Conversion runs on the host's CPU devices: parameters split over all of them (fsdp) when the sizes divide,
    else on one. Host memory is larger than an accelerator's, and nothing here is compute."""
    devices = jax.local_devices(backend="cpu")
    try:
        mesh = mesh_lib.make_mesh(MeshConfig(data=1, fsdp=len(devices), tensor=1), devices)
        return param_shardings(cfg, cfg.padded_vocab(0), mesh, rules_for("fsdp", mesh))
    except ConfigError:
        mesh = mesh_lib.make_mesh(MeshConfig(data=1, fsdp=1, tensor=1), devices[:1])
        return param_shardings(cfg, cfg.padded_vocab(0), mesh, rules_for("fsdp", mesh))
