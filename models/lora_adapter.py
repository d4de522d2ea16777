"""Read a PEFT LoRA adapter directory: untrusted input, checked before anything is parsed deeply.

    ADAPTER_DIR/adapter_config.json          peft_type LORA, r, lora_alpha, use_rslora, fan_in_fan_out,
                                             alpha_pattern / rank_pattern (literal module names only)
    ADAPTER_DIR/adapter_model.safetensors    base_model.model.<module>.lora_A.weight  A [r, in]
                                             base_model.model.<module>.lora_B.weight  B [out, r]

Each module's update is ΔW = scaling · B A ([out, in], nn.Linear's layout), scaling = alpha / r
(alpha / sqrt(r) with use_rslora), r read from A's shape. Refused, each with the fix: a missing or
non-regular file (symlinks too), pickled weights (adapter_model.bin), files over the size bounds, a
safetensors header that is too large or inconsistent with the file, a non-LoRA adapter, DoRA,
trained biases or modules_to_save (they are not a low-rank update), embedding LoRA, tensor names
or shapes that do not pair up, and regex patterns (not evaluated: an adapter could make one run
for minutes). The tensors are read only after the header checks, into float32.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from enginesmith.core.errors import UserError

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20
MAX_WEIGHTS_BYTES = 8 << 30
MAX_HEADER_BYTES = 16 << 20
MAX_TENSORS = 100_000
MAX_RANK = 4096
PREFIX = "base_model.model."
_DTYPES = {"F32": (np.float32, 4), "F16": (np.float16, 2), "BF16": (None, 2)}
_LITERAL = re.compile(r"[A-Za-z0-9_.]+")


@dataclass(frozen=True)
class LoraUpdate:
    module: str          # the module path in the HF model, e.g. model.layers.0.self_attn.q_proj
    a: np.ndarray        # [r, in] float32
    b: np.ndarray        # [out, r] float32
    scaling: float

    def delta(self) -> np.ndarray:
        """ΔW [out, in] (nn.Linear's weight layout), float64 products rounded to float32."""
        return (self.scaling * (self.b.astype(np.float64) @ self.a.astype(np.float64))).astype(np.float32)


@dataclass(frozen=True)
class Adapter:
    path: str
    sha256: str                  # config + weights, the adapter's identity in cache keys
    fan_in_fan_out: bool         # the base modules store W as [in, out] (GPT-2 Conv1D)
    updates: tuple[LoraUpdate, ...]


def _regular(path: Path, limit: int, what: str) -> int:
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        fix = ("save the adapter with safetensors (PEFT's default: save_pretrained(dir))"
               if path.name == WEIGHTS and path.with_name("adapter_model.bin").exists() else
               "pass the directory PEFT's save_pretrained wrote")
        raise UserError(f"the LoRA adapter has no {path.name} ({path.parent})", fix) from None
    if not stat.S_ISREG(info.st_mode):
        raise UserError(f"{path} is not a regular file", f"copy the real {what} into the adapter directory")
    if info.st_size > limit:
        raise UserError(f"{path} is {info.st_size} bytes, over the {limit}-byte bound for {what}",
                        "pass a LoRA adapter (low-rank matrices), not a full checkpoint")
    return info.st_size


def resolve(adapter_dir: str | os.PathLike) -> tuple[Path, str]:
    """(directory, sha256 of its config and weights) after the file checks, without parsing them."""
    folder = Path(adapter_dir)
    if not folder.is_dir():
        raise UserError(f"--lora {adapter_dir}: not a directory", "pass the directory PEFT's save_pretrained wrote")
    h = hashlib.sha256()
    for name, limit, what in ((CONFIG, MAX_CONFIG_BYTES, "an adapter config"),
                              (WEIGHTS, MAX_WEIGHTS_BYTES, "adapter weights")):
        _regular(folder / name, limit, what)
        with open(folder / name, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
    return folder, h.hexdigest()


def _config(folder: Path) -> dict:
    try:
        cfg = json.loads((folder / CONFIG).read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{folder / CONFIG} is not valid JSON ({exc})", "pass the adapter PEFT wrote") from None
    if not isinstance(cfg, dict):
        raise UserError(f"{folder / CONFIG} is not a JSON object", "pass the adapter PEFT wrote")
    checks = [(cfg.get("peft_type") == "LORA", f"peft_type is {cfg.get('peft_type')!r}, not 'LORA'"),
              (not cfg.get("use_dora"), "it is a DoRA adapter (use_dora), which is not a plain low-rank update"),
              (cfg.get("bias", "none") == "none", f"it trains biases (bias={cfg.get('bias')!r})"),
              (not cfg.get("modules_to_save"), "it saves whole modules (modules_to_save)"),
              (isinstance(cfg.get("r"), int) and 1 <= cfg["r"] <= MAX_RANK, f"r={cfg.get('r')!r} is not in 1..{MAX_RANK}"),
              (isinstance(cfg.get("lora_alpha"), (int, float)) and not isinstance(cfg.get("lora_alpha"), bool)
               and math.isfinite(cfg["lora_alpha"]), f"lora_alpha={cfg.get('lora_alpha')!r} is not a number")]
    for key in ("alpha_pattern", "rank_pattern"):
        pattern = cfg.get(key) or {}
        ok = isinstance(pattern, dict) and all(isinstance(k, str) and _LITERAL.fullmatch(k) for k in pattern)
        checks.append((ok, f"{key} must map literal module names (letters, digits, '_', '.') to numbers"))
    bad = [why for ok, why in checks if not ok]
    if bad:
        raise UserError(f"the LoRA adapter {folder} cannot be folded: {bad[0]}",
                        "fold a plain LoRA adapter (peft LoraConfig without DoRA, biases or modules_to_save)")
    return cfg


def _header(path: Path, size: int) -> tuple[dict, int]:
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise UserError(f"{path} is not a safetensors file (too short)", "save the adapter again")
        (length,) = struct.unpack("<Q", raw)
        if length > min(MAX_HEADER_BYTES, size - 8):
            raise UserError(f"{path}: its safetensors header claims {length} bytes", "save the adapter again")
        try:
            header = json.loads(f.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise UserError(f"{path}: its safetensors header is not JSON", "save the adapter again") from None
    if not isinstance(header, dict) or len(header) > MAX_TENSORS:
        raise UserError(f"{path}: the safetensors header is not a table of at most {MAX_TENSORS} tensors",
                        "save the adapter again")
    header.pop("__metadata__", None)
    data = size - 8 - length
    for name, info in header.items():
        ok = (isinstance(info, dict) and info.get("dtype") in _DTYPES and isinstance(info.get("shape"), list)
              and len(info["shape"]) == 2 and all(isinstance(d, int) and 0 < d < 1 << 31 for d in info["shape"])
              and isinstance(info.get("data_offsets"), list) and len(info["data_offsets"]) == 2
              and all(isinstance(o, int) for o in info["data_offsets"]))
        if ok:
            begin, end = info["data_offsets"]
            ok = 0 <= begin <= end <= data and end - begin == math.prod(info["shape"]) * _DTYPES[info["dtype"]][1]
        if not ok:
            raise UserError(f"{path}: tensor {name[:80]!r} is not a 2-D float tensor inside the file",
                            "save the adapter again (LoRA matrices are 2-D F32/F16/BF16)")
    return header, 8 + length


def _read(path: Path, info: dict, base: int) -> np.ndarray:
    begin, end = info["data_offsets"]
    with open(path, "rb") as f:
        f.seek(base + begin)
        raw = f.read(end - begin)
    if info["dtype"] == "BF16":
        bits = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
        return bits.view(np.float32).reshape(info["shape"])
    return np.frombuffer(raw, dtype=np.dtype(_DTYPES[info["dtype"]][0]).newbyteorder("<")) \
        .astype(np.float32).reshape(info["shape"])


def _pattern(cfg: dict, key: str, module: str, default):
    for name, value in (cfg.get(key) or {}).items():
        if module == name or module.endswith("." + name):
            return value
    return default


def read_adapter(adapter_dir: str | os.PathLike) -> Adapter:
    """The checked adapter: one LoraUpdate per adapted module."""
    folder, sha = resolve(adapter_dir)
    cfg = _config(folder)
    weights = folder / WEIGHTS
    header, base = _header(weights, weights.stat().st_size)
    pairs: dict[str, dict[str, dict]] = {}
    for name, info in header.items():
        m = re.fullmatch(r"base_model\.model\.([A-Za-z0-9_.]+)\.lora_([AB])(?:\.[A-Za-z0-9_]+)?\.weight", name)
        if m is None:
            raise UserError(f"{weights}: tensor {name[:80]!r} is not a LoRA A/B matrix of a linear layer",
                            "fold a plain LoRA adapter (no embedding LoRA, DoRA magnitudes or saved modules)")
        pairs.setdefault(m.group(1), {})[m.group(2)] = info
    updates = []
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"} or ab["A"]["shape"][0] != ab["B"]["shape"][1]:
            raise UserError(f"{weights}: {module} has no matching lora_A [r, in] and lora_B [out, r]",
                            "save the adapter again")
        r = ab["A"]["shape"][0]
        if r > MAX_RANK:
            raise UserError(f"{weights}: {module} has rank {r} > {MAX_RANK}", "fold a low-rank adapter")
        alpha = _pattern(cfg, "alpha_pattern", module, cfg["lora_alpha"])
        if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
            raise UserError(f"alpha_pattern gives {module} a non-number", "fix the adapter config")
        scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
        updates.append(LoraUpdate(module, _read(weights, ab["A"], base), _read(weights, ab["B"], base), scaling))
    if not updates:
        raise UserError(f"the LoRA adapter {folder} has no LoRA matrices", "pass the directory PEFT's save_pretrained wrote")
    return Adapter(str(folder), sha, bool(cfg.get("fan_in_fan_out")), tuple(updates))
