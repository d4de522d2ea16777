"""What a build writes into build.json: the record of an engine built from a model (`built`) and of
one lowered for CUDA from another engine (`lowered`), with their KV layout and calibration records.
core/manifest.py is the schema they are checked against when written (engine_dir.write_manifest).
"""

from __future__ import annotations

import platform
import time

from enginesmith import __version__
from enginesmith.builder.code_fingerprint import code_fingerprint
from enginesmith.builder.config import PAGED_MAX_BATCH, BuildConfig
from enginesmith.core import kv_spec
from enginesmith.core.errors import UserError
from enginesmith.core.io_names import GQA_IO, PAGED_GQA_IO


def built(config: BuildConfig, *, source, loaded, adapter, dtype: str, opset: int, pass_steps: list,
          report: list[dict], kv_layout: dict, backend: dict, started: float) -> dict:
    """build.json's fields of an engine exported from `source` (models.resolve) as `loaded` (models.load),
    with the LoRA `adapter` folded in (or None), `pass_steps` run (their `report`), started at `started`."""
    import torch  # deferred: loaded already by the export that ran; heavy to import otherwise
    import transformers  # deferred: as torch

    from enginesmith.export.kv_io import KVShape  # deferred: imports torch

    cfg = loaded.model.config
    shape = KVShape.of(cfg)
    eos = cfg.eos_token_id
    return {
        "enginesmith_version": __version__,
        "builder_code": code_fingerprint(),
        "created": _now(),
        "source": {"kind": source.kind, "path": source.path, "name": source.name, "sha256": source.sha256},
        "model": {
            "family": loaded.family.name, "architecture": loaded.family.architecture,
            "layers": shape.layers, "heads": shape.heads, "kv_heads": shape.kv_heads,
            "head_dim": shape.head_dim, "vocab": shape.vocab, "max_positions": shape.max_positions,
            "eos_token_ids": sorted(set(eos if isinstance(eos, list) else [eos] if eos is not None else [])),
            "bos_token_id": cfg.bos_token_id, "pad_token_id": cfg.pad_token_id,
        },
        "graph": "model.onnx",
        **({"lora": {"path": adapter.path, "sha256": adapter.sha256, "modules": len(adapter.updates)}}
           if adapter is not None else {}),
        "precision": dtype + (f"+{config.quant}" if config.quant else ""),
        "opset": opset if config.kv_layout == "dense" else max(opset, 24),
        "passes": [step.spec() for step in pass_steps],
        "pass_report": [{k: e[k] for k in ("name", "params", "exact", "counts", "max_diff", "seconds")}
                        for e in report],
        "calibration": calibration_note(config, pass_steps),
        "kv_layout": kv_layout,
        "backend": backend,
        "exporter": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "python": platform.python_version()},
        "build_seconds": round(time.time() - started, 1),
    }


def lowered(source, config: BuildConfig, pass_steps: list, report: list[dict], capacity: int, src) -> dict:
    """build.json's fields of the ort-cuda engine lowered from the engine at `src` (its Manifest
    `source`): the source's, with the passes appended and kv_layout.io = GQA_IO, or PAGED_GQA_IO."""
    fields = {k: v for k, v in source.raw.items() if k not in ("files", "created", "format_version")}
    fields.update(
        created=_now(), graph="model.onnx",
        builder_code=code_fingerprint(),
        passes=list(source.passes) + [step.spec() for step in pass_steps],
        pass_counts={e["name"]: e["counts"] for e in report},
        kv_layout=cuda_kv_layout(config, capacity), lowered_from=str(src))
    if config.quant:
        fields["precision"] = f"{source.precision}+w4a16"  # the name before the -rtn preset
    return fields


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def kv_layout(config: BuildConfig, max_positions: int) -> dict:
    """build.json's kv_layout, after checking the ring fits the model's context."""
    if config.kv_layout == "dense":
        return {"type": "dense", "capacity": max_positions}
    if config.kv_layout == "paged":  # a TensorRT build's page size was checked against the plugin (BuildConfig)
        return {"type": "paged", "page_size": config.page_size, "capacity": max_positions}
    if config.kv_layout == "h2o":
        if config.kv_budget > max_positions:
            raise UserError(f"an H2O cache of {config.kv_budget} slots exceeds the model's context of "
                            f"{max_positions} positions", f"use --kv-budget <= {max_positions}")
        kind, policy = kv_spec.stored_layout("h2o")
        return {"type": kind, "policy": policy, "sinks": 0, "window": config.kv_budget, "capacity": config.kv_budget}
    capacity = config.kv_sinks + config.kv_window
    if capacity > max_positions:
        raise UserError(f"a ring KV cache of {config.kv_sinks} sinks + {config.kv_window} window = {capacity} "
                        f"slots exceeds the model's context of {max_positions} positions",
                        f"use --sinks + --kv-window <= {max_positions}")
    return {"type": "ring", "sinks": config.kv_sinks, "window": config.kv_window, "capacity": capacity}


def cuda_kv_layout(config: BuildConfig, capacity: int) -> dict:
    """build.json's kv_layout of an ort-cuda engine: dense (max_batch: KV rows the runtime allocates,
    each of the full capacity) or paged (max_batch: most rows per step; pages are the runtime's choice)."""
    if config.kv_layout == "paged":
        return {"type": "paged", "io": PAGED_GQA_IO, "page_size": config.page_size, "capacity": capacity,
                "max_batch": config.max_batch or PAGED_MAX_BATCH,
                **({"kv_dtype": config.kv_dtype} if config.kv_dtype != "fp16" else {})}
    return {"type": "dense", "io": GQA_IO, "capacity": capacity,
            **({"max_batch": config.max_batch} if config.max_batch else {}),
            **({"kv_dtype": config.kv_dtype} if config.kv_dtype != "fp16" else {})}


def calibration_note(config: BuildConfig, pass_steps: list) -> dict | None:
    """build.json's calibration: the text and sample count, when a step was calibrated."""
    from enginesmith.passes.analysis.calibrate import DEFAULT_NOVEL  # deferred: imports onnx
    from enginesmith.passes.manager.steps import calibrated_steps  # deferred: imports onnx

    if not pass_steps or not calibrated_steps(pass_steps):
        return None
    return {"text": config.calib_text or f"austen:{DEFAULT_NOVEL}", "samples": config.calib_samples}
