"""Bounds on the numbers and strings a verb takes, each refused in one line that names the limit
(issue 28: `run --threads 5000` hung, `bench --batch 1000000` met the OOM killer, `--num-pages 1e9`
asked for 1.86 TiB, `--gpu-memory-utilization nan` passed, `run --engine ''` built the default model).

The argparse types refuse a value at parse time (exit 2, `error: argument --flag: ...`); the memory
checks run before anything is allocated, once the engine's shapes are known: the bytes a request would
take are compared with what the machine has free (MemAvailable, or the GPU's free memory).
"""

from __future__ import annotations

import argparse
import math
import os

from enginesmith.core.errors import UserError
from enginesmith.core.io_names import GQA_IO, PAGED_GQA_IO
from enginesmith.core.manifest import Manifest

MIB = 1 << 20


def cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def threads(text: str) -> int:
    """--threads: 0 (ONNX Runtime's default: every core) up to twice the cores."""
    value = _int(text)
    limit = 2 * cores()
    if not 0 <= value <= limit:
        raise argparse.ArgumentTypeError(f"{value} is outside 0..{limit} (twice this machine's {cores()} cores; "
                                         "0 = every core)")
    return value


def fraction(text: str) -> float:
    """--gpu-memory-utilization: a finite share in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(value) and 0.0 < value <= 1.0):
        raise argparse.ArgumentTypeError(f"{text} is not a share of the memory in (0, 1], e.g. 0.9")
    return value


def nonempty(text: str) -> str:
    """A path or name flag that must say something: '' is an error, never 'use the default'."""
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty; leave the flag out for the default")
    return text


def secret(text: str) -> str:
    """--api-key: not empty (an empty key would silently open the server), printable, no spaces."""
    if not text or any(not c.isprintable() or c.isspace() for c in text):
        raise argparse.ArgumentTypeError("must be a non-empty key of printable characters without spaces; leave "
                                         "--api-key out for an open server")
    return text


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def positive(flag: str, value: int | None) -> None:
    """A count given on the command line is >= 1."""
    if value is not None and value < 1:
        raise UserError(f"{flag} {value} is not a positive number", f"give {flag} >= 1")


# ----------------------------------------------------------------------------- memory

def available_bytes(device: str) -> tuple[int | None, str]:
    """Free memory where a buffer of `device` ("cpu" or "cuda") would go, and its name (None: unknown)."""
    if device == "cuda":
        try:
            import torch  # deferred: heavy, and only the CUDA engines need it

            if torch.cuda.is_available():
                return int(torch.cuda.mem_get_info()[0]), "free GPU memory"
        except (ImportError, RuntimeError):
            pass
        return None, "free GPU memory"
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "available RAM"
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "available RAM"
    except (ValueError, OSError, AttributeError):
        return None, "available RAM"


def kv_bytes_per_token(manifest: Manifest) -> int:
    """K and V of one token over all layers, at the engine's precision (int8 / fp8 pages: 1 byte)."""
    m = manifest.model
    kv_dtype = manifest.raw.get("kv_layout", {}).get("kv_dtype") if isinstance(manifest.raw, dict) else None
    width = 1 if kv_dtype in ("int8", "fp8") else 2 if manifest.precision.startswith(("fp16", "bf16")) else 4
    return 2 * m.layers * m.kv_heads * m.head_dim * width


def check_fits(need: int, flag: str, device: str, fix: str) -> None:
    """Refuse `need` bytes when they exceed the free memory of `device` (unknown free memory: allowed)."""
    free, where = available_bytes(device)
    if free is not None and need > free:
        raise UserError(f"{flag} needs about {need / MIB:,.0f} MiB, more than the {free / MIB:,.0f} MiB of {where}",
                        fix)


def _device(manifest: Manifest, device_flag: str) -> str:
    """Where the engine's KV lives: the GPU for a --for-cuda engine or --device cuda, else host RAM."""
    lowered = manifest.kv_layout.io in (GQA_IO, PAGED_GQA_IO)
    return "cuda" if lowered or device_flag == "cuda" or manifest.backend.name == "tensorrt" else "cpu"


def single_stream_check(batch: int, prompt_tokens: int, new_tokens: int, device_flag: str):
    """bench (single stream): the KV of `batch` rows at full length, in and out of each step, and the
    prompt's logits ([batch, prompt, vocab] fp32), checked against free memory before the engine opens."""
    def check(manifest: Manifest) -> None:
        per_row = 2 * (prompt_tokens + new_tokens) * kv_bytes_per_token(manifest) + \
            prompt_tokens * (manifest.model.vocab or 0) * 4
        check_fits(batch * per_row, f"--batch {batch}", _device(manifest, device_flag),
                   "use a smaller --batch (or fewer --prompt-tokens / --new-tokens)")
    return check


def pool_check(num_pages: int | None, device_flag: str):
    """bench --requests --num-pages K: the KV page pool (K pages of page_size tokens), checked likewise."""
    def check(manifest: Manifest) -> None:
        if num_pages is None:
            return  # the default pool is sized from memory already
        page = (manifest.kv_layout.page_size or 16) * kv_bytes_per_token(manifest)
        check_fits(num_pages * page, f"--num-pages {num_pages}", _device(manifest, device_flag),
                   "give fewer --num-pages, or leave it out for what fits")
    return check
