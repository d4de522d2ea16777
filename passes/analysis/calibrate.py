"""Calibration: activation statistics of a graph, collected once by ONNX Runtime, cached on disk.

The graph is run on N windows of real text (default: Jane Austen's *Emma*; accuracy is measured on
*Pride and Prejudice*, so the two never overlap) with the needed tensors exposed as extra graph
outputs. Per tensor X [.., K] we keep what SmoothQuant, W8A8 and AWQ need:

  amax [K]    max |X| per channel (SmoothQuant's s_X, W8A8's per-tensor scale = max over K)
  mean [K]    mean |X| per channel (AWQ's s_X)
  rows [R, K] R token rows sampled at the same positions for every tensor (AWQ / alpha search
              measure a layer's output error on them)

Statistics are cached under cache_dir()/calib keyed by (graph content hash, calibration set, N).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from enginesmith.core import io_names
from enginesmith.core.errors import UserError
from enginesmith.core.paths import cache_dir
from enginesmith.core.progress import bar as progress_bar
from enginesmith.models.corpus import load_text, tokenize

DEFAULT_NOVEL = "emma"
DEFAULT_SAMPLES = 32
DEFAULT_SEQ_LEN = 512
DEFAULT_ROWS = 512


@dataclass(frozen=True)
class CalibrationSet:
    """N windows of token ids [N, S] and where they came from."""

    name: str
    windows: np.ndarray

    @property
    def samples(self) -> int:
        return int(self.windows.shape[0])

    @property
    def key(self) -> str:
        h = hashlib.sha256(self.name.encode())
        h.update(np.ascontiguousarray(self.windows, dtype=np.int64).tobytes())
        return h.hexdigest()[:16]

    def to_json(self) -> dict:
        return {"name": self.name, "samples": self.samples, "seq_len": int(self.windows.shape[1]),
                "key": self.key}

    def activation_stats(self, onnx_path: str | os.PathLike, names: list[str], progress: bool = True) -> dict:
        """`collect` over this set: what PassContext.stats asks the calibration it was given."""
        return collect(onnx_path, names, self, progress=progress)


def from_tokens(tokens, name: str, samples: int = DEFAULT_SAMPLES,
                seq_len: int = DEFAULT_SEQ_LEN) -> CalibrationSet:
    """`samples` windows of `seq_len` tokens spread evenly over `tokens` (1-D ids)."""
    tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
    if samples < 1 or seq_len < 16:
        raise UserError(f"calibration needs at least 1 sample of 16 tokens (got {samples} x {seq_len})",
                        "use --calib-samples >= 1 and --calib-seq-len >= 16")
    need = samples * seq_len
    if len(tokens) < need:
        raise UserError(f"calibration text {name!r} has {len(tokens)} tokens; {samples} samples of "
                        f"{seq_len} tokens need {need}",
                        "pass a longer text, or fewer/shorter samples (--calib-samples, --calib-seq-len)")
    starts = np.linspace(0, len(tokens) - seq_len, samples).astype(np.int64)
    return CalibrationSet(name, np.stack([tokens[s:s + seq_len] for s in starts]))


def calibration_set(tokenizer, text_path: str | os.PathLike | None = None, novel: str = DEFAULT_NOVEL,
                    samples: int = DEFAULT_SAMPLES, seq_len: int = DEFAULT_SEQ_LEN) -> CalibrationSet:
    """Tokenize a text file (or the Austen novel `novel`) into a CalibrationSet."""
    text = load_text(text_path, novel=novel)
    if text_path is None:
        name = f"austen:{novel}"
    else:
        name = f"file:{Path(text_path).name}:{hashlib.sha256(text.encode()).hexdigest()[:12]}"
    return from_tokens(tokenize(tokenizer, text), name, samples, seq_len)


@dataclass
class ActStats:
    amax: np.ndarray   # [K] float32
    mean: np.ndarray   # [K] float32
    rows: np.ndarray   # [R, K] float32

    @property
    def tensor_max(self) -> float:
        return float(self.amax.max())


def graph_hash(onnx_path: Path) -> str:
    """sha256 of the graph file and its external data file."""
    h = hashlib.sha256()
    for path in (onnx_path, onnx_path.with_name(onnx_path.name + ".data")):
        if path.exists():
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 24), b""):
                    h.update(block)
    return h.hexdigest()[:24]


def collect(onnx_path: str | os.PathLike, names: list[str], calib: CalibrationSet,
            rows: int = DEFAULT_ROWS, progress: bool = True, use_cache: bool = True) -> dict[str, ActStats]:
    """Statistics of the tensors `names` of the graph at `onnx_path` over `calib` (cached)."""
    onnx_path = Path(onnx_path)
    key = f"{graph_hash(onnx_path)}-{calib.key}-n{calib.samples}-r{rows}"
    cache = cache_dir() / "calib" / f"{key}.npz"
    cached = _load(cache) if use_cache and cache.is_file() else {}
    missing = sorted(set(names) - set(cached))
    if missing:
        cached.update(_run(onnx_path, missing, calib, rows, progress))
        if use_cache:
            _save(cache, cached)
    return {n: cached[n] for n in names}


def open_session(onnx_path: Path, names: list[str], elem_type: int | None = None, ops_lib: Path | None = None,
                 device: str = "cpu"):
    """An ORT session (the CPU, or with device "cuda" ORT's CUDA provider first) of the graph with the
    tensors `names` exposed as extra outputs (of ONNX type `elem_type`, default FLOAT), with enginesmith's
    ORT ops registered when `ops_lib` is given."""
    import onnx  # deferred: heavy, only when statistics are not cached
    import onnxruntime as ort  # deferred: heavy, only when statistics are not cached

    proto = onnx.load(str(onnx_path), load_external_data=False)
    present = {o.name for o in proto.graph.output}
    elem_type = onnx.TensorProto.FLOAT if elem_type is None else elem_type
    for name in names:
        if name not in present:
            proto.graph.output.append(onnx.helper.make_tensor_value_info(name, elem_type, None))
    fd, tmp = tempfile.mkstemp(prefix=".calib-", suffix=".onnx", dir=onnx_path.parent)
    os.close(fd)
    try:
        onnx.save(proto, tmp)  # same directory: the external data location still resolves
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        opts.log_severity_level = 3
        if ops_lib is not None:
            opts.register_custom_ops_library(str(ops_lib))
        providers = ["CUDAExecutionProvider", "CPUExecutionProvider"] if device == "cuda" else ["CPUExecutionProvider"]
        session = ort.InferenceSession(tmp, opts, providers=providers)
    finally:
        os.unlink(tmp)
    if device == "cuda" and "CUDAExecutionProvider" not in session.get_providers():
        raise UserError(f"calibration on cuda: ONNX Runtime {ort.__version__} has no CUDA provider here "
                        f"(it has {', '.join(ort.get_available_providers())})",
                        "install onnxruntime-gpu on a machine with an NVIDIA GPU, or calibrate on the cpu")
    return session


def run_windows(session, names: list[str], calib: CalibrationSet, progress: bool, desc: str = "calibrating"):
    """Yield the tensors `names` (a list of arrays) for each calibration window, in order."""

    feeds_base = _empty_cache_feeds(session)
    seq = calib.windows.shape[1]
    for window in progress_bar(iterable=calib.windows, desc=desc, unit="sample", disable=not progress, leave=False):
        feeds = dict(feeds_base, input_ids=window[None], attention_mask=np.ones((1, seq), np.int64),
                     position_ids=np.arange(seq, dtype=np.int64)[None])
        yield session.run(names, feeds)


def _run(onnx_path: Path, names: list[str], calib: CalibrationSet, rows: int,
         progress: bool) -> dict[str, ActStats]:
    session = open_session(onnx_path, names)
    seq = calib.windows.shape[1]
    per_sample = -(-rows // calib.samples)
    rng = np.random.default_rng(0)
    acc = {n: {"amax": None, "sum": None, "rows": []} for n in names}
    for outs in run_windows(session, names, calib, progress):
        pick = rng.choice(seq, size=min(per_sample, seq), replace=False)
        for name, x in zip(names, outs):
            x = x.reshape(-1, x.shape[-1]).astype(np.float32, copy=False)
            a = acc[name]
            absx = np.abs(x)
            a["amax"] = absx.max(0) if a["amax"] is None else np.maximum(a["amax"], absx.max(0))
            a["sum"] = absx.sum(0, dtype=np.float64) + (0 if a["sum"] is None else a["sum"])
            a["rows"].append(x[pick])
    count = calib.samples * seq
    return {n: ActStats(a["amax"], (a["sum"] / count).astype(np.float32), np.concatenate(a["rows"])[:rows])
            for n, a in acc.items()}


def _empty_cache_feeds(session) -> dict[str, np.ndarray]:
    """Empty past KV tensors [1, Hkv, 0, D] for every past input of an exported graph."""
    feeds = {}
    for inp in session.get_inputs():
        if io_names.is_past(inp.name):
            dtype = np.float16 if "float16" in inp.type else np.float32
            feeds[inp.name] = np.zeros((1, int(inp.shape[1]), 0, int(inp.shape[3])), dtype)
    return feeds


def _save(path: Path, stats: dict[str, ActStats]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    names = sorted(stats)
    arrays = {"names": np.array(json.dumps(names))}
    for i, n in enumerate(names):
        arrays[f"amax{i}"], arrays[f"mean{i}"] = stats[n].amax, stats[n].mean
        arrays[f"rows{i}"] = stats[n].rows
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".npz", dir=path.parent)
    os.close(fd)
    try:
        np.savez(tmp, **arrays)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _load(path: Path) -> dict[str, ActStats]:
    with np.load(path) as z:
        names = json.loads(str(z["names"]))
        return {n: ActStats(z[f"amax{i}"], z[f"mean{i}"], z[f"rows{i}"]) for i, n in enumerate(names)}
