"""build.json: the one typed, versioned schema of an engine directory's manifest.

`parse` validates a decoded build.json once, at the edge, with a message per field
(``field 'model.max_positions' must be a positive integer (got 'lots')``) and returns a frozen
`Manifest`. Nothing else in enginesmith reads build.json's dict: code reads `manifest.model.vocab`,
`manifest.kv_layout.type`, `manifest.backend.plan`, ...

Every path the manifest names (the graph, `files`, the TensorRT plan and plugin libraries) is
checked here to be relative, normalized and inside the directory (`check_relative_path`); that the
file is really there, a regular file of the listed size and hash, is engine_dir's job.

Format history: 1 listed `files` as {path: sha256}; 2 (this one) lists {path: {sha256, size}} so
sizes are checked before anything is hashed or parsed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from pathlib import PurePosixPath
from typing import Any, Callable, Mapping

from enginesmith.core import kv_spec
from enginesmith.core.errors import EngineError
from enginesmith.core.io_names import GQA_IO, PAGED_GQA_IO

FORMAT_VERSION = 2
MAX_FILES = 4096          # an engine holds a graph, its data, a tokenizer, maybe a plan and plugins
MAX_PATH_CHARS = 512
KV_TYPES = kv_spec.LAYOUTS
KV_IOS = {GQA_IO: "dense", PAGED_GQA_IO: "paged"}  # kv_layout.io (a CUDA-lowered graph's interface) -> its type
_SHA256 = re.compile(r"[0-9a-f]{64}")


class ManifestError(EngineError):
    """One field of build.json is missing or of the wrong type or value."""


def check_relative_path(value: object, where: str) -> str:
    """`value` as a normalized relative posix path that cannot leave its directory, or ManifestError."""
    if not isinstance(value, str) or not value:
        raise ManifestError(f"field {where!r} must be a non-empty relative path (got {_show(value)})",
                            "rebuild the engine")
    parts = PurePosixPath(value).parts
    bad = (len(value) > MAX_PATH_CHARS or "\x00" in value or "\\" in value or value.startswith("/")
           or any(p in ("", ".", "..") for p in value.split("/")) or not parts)
    if bad:
        raise ManifestError(f"field {where!r} names {_show(value)}, which is not a plain relative path inside "
                            "the engine directory (absolute paths and '..' are refused)",
                            "rebuild the engine; never edit build.json by hand")
    return value


# ----------------------------------------------------------------------------- typed sections

@dataclass(frozen=True)
class FileRecord:
    sha256: str
    size: int


@dataclass(frozen=True)
class Source:
    kind: str = ""
    path: str = ""
    name: str = ""
    sha256: str = ""


@dataclass(frozen=True)
class ModelInfo:
    max_positions: int
    family: str = ""
    architecture: str = ""
    layers: int | None = None
    heads: int | None = None
    kv_heads: int | None = None
    head_dim: int | None = None
    vocab: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    pad_token_id: int | None = None


@dataclass(frozen=True)
class KVLayout:
    type: str = "dense"
    capacity: int | None = None
    sinks: int | None = None
    window: int | None = None
    page_size: int | None = None
    io: str | None = None       # lowered for ONNX Runtime CUDA: "gqa-shared-buffer" (dense) or "paged-gqa"
    max_batch: int | None = None  # rows of a CUDA engine's KV buffer, or of a paged one's step (--max-batch)
    policy: str | None = None   # ring: "streaming" (sinks + window) or "h2o" (heavy hitters); absent = streaming
    kv_dtype: str | None = None  # CUDA engines: the KV format, "int8" or "fp8"; absent = fp16

    def as_dict(self) -> dict:
        """The layout as build.json writes it (fields that are set)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


@dataclass(frozen=True)
class PluginFile:
    file: str
    sha256: str = ""
    source: str = ""


@dataclass(frozen=True)
class Backend:
    name: str
    version: str | None = None
    # TensorRT only
    plan: str | None = None
    plugins: tuple[PluginFile, ...] = ()
    sm: str | None = None
    device: str | None = None
    flags: tuple[str, ...] = ()
    weights: str | None = None            # "in-plan" | "refit-from-onnx"
    weight_streaming: bool = False
    hardware_compatibility: str = "none"
    max_batch: int | None = None
    max_input: int | None = None
    max_positions: int | None = None


@dataclass(frozen=True)
class Manifest:
    """A validated build.json. `raw` keeps the decoded document (for writing derived manifests and
    for fields no runtime decision depends on: pass reports, timings, exporter versions)."""

    format_version: int
    graph: str
    files: Mapping[str, FileRecord]
    model: ModelInfo
    backend: Backend
    kv_layout: KVLayout = KVLayout()
    precision: str = ""
    opset: int | None = None
    source: Source = Source()
    passes: tuple[str, ...] = ()
    enginesmith_version: str = ""
    raw: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def max_positions(self) -> int:
        """Most positions one sequence may use: the model's, capped by a TensorRT profile's."""
        cap = self.backend.max_positions
        return min(self.model.max_positions, cap) if cap else self.model.max_positions


# ----------------------------------------------------------------------------- validation

def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _kind(value: object) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null",
            int: "an integer", float: "a number"}.get(type(value), type(value).__name__)


class _Fields:
    """Typed reads of one JSON object, each failure a ManifestError naming the dotted field."""

    def __init__(self, data: object, where: str) -> None:
        if not isinstance(data, dict):
            raise ManifestError(f"{where or 'build.json'} must be a JSON object (got {_kind(data)})",
                                "rebuild the engine")
        self.data, self.where = data, where

    def _name(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def _fail(self, key: str, wanted: str) -> ManifestError:
        value = self.data.get(key)
        got = "missing" if key not in self.data else "got null" if value is None else f"got {_kind(value)} {_show(value)}"
        return ManifestError(f"field {self._name(key)!r} must be {wanted} ({got})", "rebuild the engine")

    def get(self, key: str, check: Callable[[object], bool], wanted: str, default: object = None,
            required: bool = False) -> Any:
        if key not in self.data or (self.data[key] is None and not required):
            if required:
                raise self._fail(key, wanted)
            return default
        value = self.data[key]
        if not check(value):
            raise self._fail(key, wanted)
        return value

    def text(self, key: str, default: str | None = "", required: bool = False) -> Any:
        return self.get(key, lambda v: isinstance(v, str) and "\x00" not in v and len(v) <= 4096, "a string",
                        default, required)

    def integer(self, key: str, low: int = 0, required: bool = False) -> Any:
        return self.get(key, lambda v: _is_int(v) and low <= v < 1 << 62, f"an integer >= {low}", None, required)

    def flag(self, key: str) -> bool:
        return bool(self.get(key, lambda v: isinstance(v, bool), "true or false", False))

    def obj(self, key: str, required: bool = False) -> "_Fields":
        value = self.get(key, lambda v: isinstance(v, dict), "an object", {}, required)
        return _Fields(value, self._name(key))

    def strings(self, key: str) -> tuple[str, ...]:
        value = self.get(key, lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
                         "a list of strings", [])
        return tuple(value)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _files(data: _Fields) -> dict[str, FileRecord]:
    raw = data.get("files", lambda v: isinstance(v, dict), "an object {path: {sha256, size}}", required=True)
    if len(raw) > MAX_FILES:
        raise ManifestError(f"field 'files' lists {len(raw)} files, more than an engine holds ({MAX_FILES})",
                            "rebuild the engine")
    out: dict[str, FileRecord] = {}
    for rel, record in raw.items():
        check_relative_path(rel, f"files.{rel}")
        if rel == "build.json":
            raise ManifestError("field 'files' lists build.json itself", "rebuild the engine")
        entry = _Fields(record, f"files.{rel}")
        digest = entry.get("sha256", lambda v: isinstance(v, str) and bool(_SHA256.fullmatch(v)),
                           "64 lowercase hex digits", required=True)
        out[rel] = FileRecord(digest, entry.integer("size", 0, required=True))
    return out


def _model(data: _Fields) -> ModelInfo:
    m = data.obj("model", required=True)
    eos = m.get("eos_token_ids", lambda v: isinstance(v, list) and all(_is_int(x) and 0 <= x < 1 << 31 for x in v),
                "a list of token ids (integers >= 0)", [])
    return ModelInfo(
        max_positions=m.integer("max_positions", 1, required=True), family=m.text("family"),
        architecture=m.text("architecture"), layers=m.integer("layers", 1), heads=m.integer("heads", 1),
        kv_heads=m.integer("kv_heads", 1), head_dim=m.integer("head_dim", 1), vocab=m.integer("vocab", 1),
        eos_token_ids=tuple(eos), bos_token_id=m.integer("bos_token_id"), pad_token_id=m.integer("pad_token_id"))


def _kv_layout(data: _Fields) -> KVLayout:
    kv = data.obj("kv_layout")
    kind = kv.get("type", lambda v: v in KV_TYPES, f"one of {', '.join(KV_TYPES)}", "dense")
    io = kv.get("io", lambda v: v in KV_IOS, f"{' or '.join(map(repr, KV_IOS))} or absent")
    layout = KVLayout(type=kind, capacity=kv.integer("capacity", 1), sinks=kv.integer("sinks", 0),
                      window=kv.integer("window", 1), page_size=kv.integer("page_size", 1), io=io,
                      max_batch=kv.integer("max_batch", 1),
                      policy=kv.get("policy", lambda v: v in kv_spec.RING_POLICIES and kind == "ring",
                                    f"one of {', '.join(kv_spec.RING_POLICIES)} (ring only) or absent"),
                      kv_dtype=kv.get("kv_dtype", lambda v: v in kv_spec.KV_DTYPES,
                                      f"one of {', '.join(kv_spec.KV_DTYPES)} or absent"))
    if kind == "ring" and (layout.sinks is None or layout.window is None):
        raise ManifestError("field 'kv_layout' of type ring needs integer 'sinks' and 'window'", "rebuild the engine")
    if kind == "paged" and layout.page_size is None:
        raise ManifestError("field 'kv_layout' of type paged needs an integer 'page_size'", "rebuild the engine")
    if io is not None and KV_IOS[io] != kind:
        raise ManifestError(f"field 'kv_layout.io' {io!r} belongs to type {KV_IOS[io]}, not {kind}", "rebuild the engine")
    return layout


def _backend(data: _Fields) -> Backend:
    b = data.obj("backend", required=True)
    name = b.text("name", required=True)
    plan = b.get("plan", lambda v: isinstance(v, str), "a relative path")
    if plan is not None:
        check_relative_path(plan, "backend.plan")
    raw_plugins = b.get("plugins", lambda v: isinstance(v, list), "a list of {file, sha256}", [])
    plugins = []
    for i, entry in enumerate(raw_plugins):
        p = _Fields(entry, f"backend.plugins[{i}]")
        plugins.append(PluginFile(check_relative_path(p.text("file", required=True), f"backend.plugins[{i}].file"),
                                  p.text("sha256"), p.text("source")))
    return Backend(
        name=name, version=b.text("version", None), plan=plan, plugins=tuple(plugins), sm=b.text("sm", None),
        device=b.text("device", None), flags=b.strings("flags"),
        weights=b.get("weights", lambda v: v in ("in-plan", "refit-from-onnx"), "'in-plan' or 'refit-from-onnx'"),
        weight_streaming=b.flag("weight_streaming"),
        hardware_compatibility=b.text("hardware_compatibility", "none") or "none",
        max_batch=b.integer("max_batch", 1), max_input=b.integer("max_input", 1),
        max_positions=b.integer("max_positions", 1))


def parse(data: object) -> Manifest:
    """Validate a decoded build.json (any JSON value) into a Manifest, or raise ManifestError."""
    top = _Fields(data, "")
    version = top.get("format_version", _is_int, "an integer", required=True)
    if version != FORMAT_VERSION:
        raise ManifestError(f"engine format {version} is not the one this enginesmith reads ({FORMAT_VERSION})",
                            "rebuild the engine with this enginesmith")
    graph = check_relative_path(top.get("graph", lambda v: isinstance(v, str), "a relative path", required=True),
                                "graph")
    files = _files(top)
    if graph not in files:
        raise ManifestError(f"field 'graph' names {graph!r}, which 'files' does not list", "rebuild the engine")
    backend = _backend(top)
    for extra in ([backend.plan] if backend.plan else []) + [p.file for p in backend.plugins]:
        if extra not in files:
            raise ManifestError(f"backend file {extra!r} is not listed in 'files'", "rebuild the engine")
    source = top.obj("source")
    opset = top.integer("opset", 1)
    return Manifest(
        format_version=version, graph=graph, files=files, model=_model(top), backend=backend,
        kv_layout=_kv_layout(top), precision=top.text("precision"), opset=opset,
        source=Source(source.text("kind"), source.text("path"), source.text("name"), source.text("sha256")),
        passes=top.strings("passes"), enginesmith_version=top.text("enginesmith_version"), raw=data)
