"""A checkpoint's config.json, read as untrusted input: bounded, decoded and checked field by field.

transformers trusts config.json: garbage bytes give a JSONDecodeError, `num_attention_heads: 0` a
ZeroDivisionError, a missing size a 7B-default model whose weights then do not fit. `read` turns
each of those into one UserError naming the file and the field, before any weights are read.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from enginesmith.core.errors import UserError
from enginesmith.models.families import check_config, family_of

MAX_BYTES = 4 << 20   # real config.json files are a few kB; bound what we read and parse
FIX = "repair the checkpoint's config.json, or pass a checkpoint written by transformers' save_pretrained"

# (field, required, upper bound) of the positive integer sizes each family's config must hold
_SIZES = {
    "rms": [("hidden_size", True, 1 << 20), ("intermediate_size", True, 1 << 22),
            ("num_hidden_layers", True, 4096), ("num_attention_heads", True, 4096),
            ("num_key_value_heads", False, 4096), ("head_dim", False, 1 << 16),
            ("vocab_size", True, 1 << 24), ("max_position_embeddings", False, 1 << 26)],
    "layer": [("n_embd", True, 1 << 20), ("n_layer", True, 4096), ("n_head", True, 4096),
              ("n_inner", False, 1 << 22), ("vocab_size", True, 1 << 24), ("n_positions", False, 1 << 26)],
}
_POSITIVE_NUMBERS = ("rope_theta", "rms_norm_eps", "layer_norm_epsilon")


def _kind(value: object) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null",
            int: "an integer", float: "a number"}.get(type(value), type(value).__name__)


def _show(value: object) -> str:
    text = json.dumps(value) if not isinstance(value, (dict, list)) else _kind(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _decode(path: Path, data: bytes) -> dict:
    if b"\x00" in data:
        raise UserError(f"{path} is not a text file (it holds NUL bytes)", FIX)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"{path} is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start})",
                        FIX) from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})",
                        FIX) from None
    except (ValueError, RecursionError):  # an integer of thousands of digits; nesting past the stack
        raise UserError(f"{path} is not a JSON file this reader accepts (a number too long or nesting too deep)",
                        FIX) from None
    if not isinstance(config, dict):
        raise UserError(f"{path} must hold a JSON object (got {_kind(config)})", FIX)
    return config


def _positive_int(path: Path, config: dict, key: str, required: bool, upper: int) -> int | None:
    if key not in config or (config[key] is None and not required):
        if required:
            raise UserError(f"{path}: field {key!r} is missing", FIX)
        return None
    value = config[key]
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= upper:
        raise UserError(f"{path}: field {key!r} must be an integer from 1 to {upper} (got {_show(value)})", FIX)
    return value


def check(path: Path, config: dict) -> None:
    """Raise a UserError naming `path` and the field if `config` cannot describe a supported model."""
    model_type = config.get("model_type")
    archs = config.get("architectures")
    if archs is not None and not (isinstance(archs, list) and archs
                                  and all(isinstance(a, str) and a for a in archs)):
        raise UserError(f"{path}: field 'architectures' must be a list of class names (got {_show(archs)})", FIX)
    if model_type is None:
        hint = f" (architectures says {archs[0]})" if archs else ""
        raise UserError(f"{path}: field 'model_type' is missing{hint}", FIX)
    if not isinstance(model_type, str):
        raise UserError(f"{path}: field 'model_type' must be a string (got {_show(model_type)})", FIX)
    family = family_of(SimpleNamespace(model_type=model_type, architectures=archs))
    check_config(family, config)
    sizes = {key: _positive_int(path, config, key, required, upper) for key, required, upper in _SIZES[family.norm]}
    for key in _POSITIVE_NUMBERS:
        value = config.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not 0 < value < float("inf")):
            raise UserError(f"{path}: field {key!r} must be a positive number (got {_show(value)})", FIX)
    names = ("n_embd", "n_head") if family.norm == "layer" else ("hidden_size", "num_attention_heads")
    hidden, heads = int(sizes[names[0]] or 0), int(sizes[names[1]] or 0)  # required: never None here
    kv_heads, head_dim = sizes.get("num_key_value_heads"), sizes.get("head_dim")
    if head_dim is None and hidden % heads:
        raise UserError(f"{path}: field {names[0]!r} ({hidden}) is not divisible by {names[1]!r} ({heads})", FIX)
    if kv_heads is not None and heads % kv_heads:
        raise UserError(f"{path}: field 'num_key_value_heads' ({kv_heads}) does not divide "
                        f"'num_attention_heads' ({heads})", FIX)


def read(path: Path) -> dict:
    """The checked contents of a config.json that is already known to be a regular file."""
    with open(path, "rb") as f:
        data = f.read(MAX_BYTES + 1)
    if len(data) > MAX_BYTES:
        raise UserError(f"{path} is larger than {MAX_BYTES >> 20} MB, which no config.json is", FIX)
    config = _decode(path, data)
    check(path, config)
    return config
