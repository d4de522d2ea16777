"""`enginesmith triton`: an engine directory -> a Triton Inference Server model repository.

    <repo>/<model>/config.pbtxt      python backend, decoupled (one response per text delta)
    <repo>/<model>/1/model.py        a shim: `from enginesmith.serving.triton_model import TritonPythonModel`
    <repo>/<model>/1/engine/         only with copy_engine=True (copies of the listed files)

The model drives our own runtime over the engine. How it serves depends on the engine's KV layout:

    paged KV (`build --kv paged`, or `--for-cuda --kv paged`)   one scheduler loop (serving/loop.py) for
        all of Triton's requests: in-flight batching, MAX_BATCH rows per step over NUM_PAGES KV pages,
        at most MAX_WAITING requests queued (beyond that: an UNAVAILABLE "overloaded" error)
    any other engine (dense, ring, CUDA-lowered dense, TensorRT)  WORKERS threads, each generating one
        request at a time (a TensorRT engine: one at a time in all)

The writer takes either (a TensorRT plan has no paged layout yet, so requiring one would drop it) and
says on stderr when an engine will be served one request per worker. For TensorRT engines the plan and
plugin library paths are written into the config as parameters (TRT_PLAN, TRT_PLUGINS) and checked
here, at write time.

Instances: without `gpus` the config has no instance_group: Triton makes one instance on each GPU it
sees, or one CPU instance on a machine without GPUs (the CPU case: KIND_CPU groups are not needed).
`gpus=(0, 1)` writes one group per GPU, `{ kind: KIND_GPU, count: 1, gpus: [ i ] }`: one replica of
the engine (its own process, scheduler loop and KV pool) on each GPU named, and none elsewhere. The
model pins itself to its instance's GPU (CUDA_VISIBLE_DEVICES, see triton_model.instance_gpu).

Request tensors (all but text_input optional; names follow Triton's generate extension):
    text_input [1] string   max_tokens [1] int64   temperature [1] fp32   top_k [1] int64
    top_p [1] fp32          repetition_penalty [1] fp32   seed [1] int64  stop [-1] string
    raw [1] bool            system [1] string
Responses: text_output [1] string (the new text), and on the last one token_ids [-1] int64 (every
generated id) and finish_reason [1] string ("stop" | "length").

The integer inputs are int64 so that Triton itself never narrows a client's number (with int32, the
HTTP front end turned max_tokens=10**12 into -727379968 before the model saw it); the model checks
each value's range as a Python int.

Request text is untrusted: special-token spellings in text_input and system (say
"<|im_end|><|im_start|>system") are encoded as plain text, so a client cannot open turns of its own
making. A deployer who wants clients to write control tokens sets SPECIAL_TOKENS_IN_TEXT=1
(`enginesmith triton --allow-special-tokens-in-text`). It is a model parameter, not a request
input, on purpose: a request switch would let any client undo the deployer's choice.
"""

from __future__ import annotations

import argparse
import os
import shutil
import stat
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from enginesmith.core import engine_dir
from enginesmith.core.errors import EngineError, UserError
from enginesmith.core.manifest import Manifest
from enginesmith.serving.engine_core import PLACEMENTS

MODEL_SHIM = '''"""Triton python-backend model written by `enginesmith triton`; the logic lives in the package."""
from enginesmith.serving.triton_model import TritonPythonModel  # noqa: F401
'''


@dataclass(frozen=True)
class Tensor:
    name: str
    dtype: str          # Triton config type
    dims: tuple[int, ...] = (1,)
    optional: bool = True


INPUTS = (
    Tensor("text_input", "TYPE_STRING", optional=False),
    Tensor("max_tokens", "TYPE_INT64"),
    Tensor("temperature", "TYPE_FP32"),
    Tensor("top_k", "TYPE_INT64"),
    Tensor("top_p", "TYPE_FP32"),
    Tensor("repetition_penalty", "TYPE_FP32"),
    Tensor("seed", "TYPE_INT64"),
    Tensor("stop", "TYPE_STRING", (-1,)),
    Tensor("raw", "TYPE_BOOL"),
    Tensor("system", "TYPE_STRING"),
)
OUTPUTS = (
    Tensor("text_output", "TYPE_STRING"),
    Tensor("token_ids", "TYPE_INT64", (-1,)),
    Tensor("finish_reason", "TYPE_STRING"),
)
DEFAULT_MAX_TOKENS = 256
DEFAULT_MAX_WAITING = 256


@dataclass(frozen=True)
class ModelOptions:
    """What the python model reads from config.pbtxt's parameters (all strings there)."""

    engine: str                       # engine directory, absolute or relative to the model directory
    device: str = "auto"              # ONNX Runtime: auto | cpu | cuda
    threads: int = 0                  # intra-op threads, 0 = the backend's default
    workers: int = 1                  # requests generated at once (each holds its own KV cache)
    verify_hashes: bool = True        # sha256 every engine file at load (slow for big engines)
    max_tokens: int = DEFAULT_MAX_TOKENS
    special_tokens_in_text: bool = False  # request text may spell control tokens (trusted clients only)
    # paged engines (one scheduler loop): rows per step (0 = the engine's: a CUDA paged engine's build
    # --max-batch, else DEFAULT_MAX_BATCH), KV pages (0 = what fits: runtime.load.paged_model, or the
    # CUDA engine's share of GPU memory), requests queued before new ones are refused as overloaded
    max_batch: int = 0
    num_pages: int = 0
    max_waiting: int = DEFAULT_MAX_WAITING
    # a paged ONNX Runtime engine's scheduler loop: in the stub's process (thread) or an engine core
    # process of its own (process); auto: a process on a GPU (serving/engine_core.py, core_placement)
    engine_core: str = "auto"

    def parameters(self) -> dict[str, str]:
        return {"ENGINE_DIR": self.engine, "DEVICE": self.device, "THREADS": str(self.threads),
                "WORKERS": str(self.workers), "VERIFY_HASHES": "1" if self.verify_hashes else "0",
                "DEFAULT_MAX_TOKENS": str(self.max_tokens),
                "SPECIAL_TOKENS_IN_TEXT": "1" if self.special_tokens_in_text else "0",
                "MAX_BATCH": str(self.max_batch), "NUM_PAGES": str(self.num_pages),
                "MAX_WAITING": str(self.max_waiting), "ENGINE_CORE": self.engine_core}

    @classmethod
    def from_parameters(cls, params: Mapping[str, str]) -> "ModelOptions":
        def integer(key: str, default: int, low: int) -> int:
            raw = params.get(key, str(default))
            try:
                value = int(raw)
            except ValueError:
                raise UserError(f"config parameter {key}={raw!r} is not an integer",
                                f"set it to an integer >= {low} in config.pbtxt") from None
            if value < low:
                raise UserError(f"config parameter {key}={value} is below {low}", "fix config.pbtxt")
            return value

        def flag(key: str, default: bool) -> bool:
            raw = params.get(key, "1" if default else "0")
            if raw not in ("0", "1", "false", "true", "False", "True"):
                raise UserError(f"config parameter {key}={raw!r} is not 0 or 1", f"set {key} to 0 or 1 in config.pbtxt")
            return raw in ("1", "true", "True")

        def choice(key: str, default: str, allowed: Sequence[str]) -> str:
            raw = params.get(key, default)
            if raw not in allowed:
                raise UserError(f"config parameter {key}={raw!r} is not one of {', '.join(allowed)}",
                                f"set {key} to one of them in config.pbtxt")
            return raw

        if not params.get("ENGINE_DIR"):
            raise UserError("config.pbtxt has no ENGINE_DIR parameter",
                            "regenerate the repository with `enginesmith triton`")
        return cls(engine=params["ENGINE_DIR"], device=params.get("DEVICE", "auto"),
                   threads=integer("THREADS", 0, 0), workers=integer("WORKERS", 1, 1),
                   verify_hashes=params.get("VERIFY_HASHES", "1") not in ("0", "false", "False"),
                   max_tokens=integer("DEFAULT_MAX_TOKENS", DEFAULT_MAX_TOKENS, 1),
                   special_tokens_in_text=flag("SPECIAL_TOKENS_IN_TEXT", False),
                   max_batch=integer("MAX_BATCH", 0, 0), num_pages=integer("NUM_PAGES", 0, 0),
                   max_waiting=integer("MAX_WAITING", DEFAULT_MAX_WAITING, 1),
                   engine_core=choice("ENGINE_CORE", "auto", PLACEMENTS))


def is_paged(manifest: Manifest) -> bool:
    """Whether the engine has a paged KV cache, which the model serves through one scheduler loop."""
    return manifest.kv_layout.type == "paged"


def _tensor_block(t: Tensor, with_optional: bool) -> str:
    dims = ", ".join(str(d) for d in t.dims)
    optional = "\n    optional: true" if with_optional and t.optional else ""
    return f'  {{\n    name: "{t.name}"\n    data_type: {t.dtype}\n    dims: [ {dims} ]{optional}\n  }}'


def _quote(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def config_pbtxt(model_name: str, parameters: Mapping[str, str], gpus: Sequence[int] = ()) -> str:
    """The model's config.pbtxt: python backend, decoupled, no batching by Triton (we batch); with
    `gpus`, one instance group per GPU."""
    inputs = ",\n".join(_tensor_block(t, True) for t in INPUTS)
    outputs = ",\n".join(_tensor_block(t, False) for t in OUTPUTS)
    params = "".join(f"parameters: {{\n  key: {_quote(k)}\n  value: {{ string_value: {_quote(v)} }}\n}}\n"
                     for k, v in parameters.items())
    groups = ",\n".join(f"  {{ kind: KIND_GPU, count: 1, gpus: [ {g} ] }}" for g in gpus)
    instances = f"instance_group [\n{groups}\n]\n" if gpus else ""
    return (f"# Written by `enginesmith triton`. Streams one response per text delta (decoupled).\n"
            f"name: {_quote(model_name)}\n"
            f'backend: "python"\n'
            f"max_batch_size: 0\n"
            f"model_transaction_policy {{\n  decoupled: true\n}}\n"
            f"{instances}"
            f"input [\n{inputs}\n]\n"
            f"output [\n{outputs}\n]\n"
            f"{params}")


def parse_gpus(text: str) -> tuple[int, ...]:
    """`--gpus 0,1` -> (0, 1): distinct CUDA device ordinals, as the server sees them."""
    try:
        gpus = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise UserError(f"--gpus {text!r} is not a list of GPU numbers", "give e.g. --gpus 0,1") from None
    if not gpus or any(g < 0 for g in gpus) or len(set(gpus)) != len(gpus):
        raise UserError(f"--gpus {text!r} must name distinct GPUs, numbered from 0", "give e.g. --gpus 0,1")
    return gpus


def _trt_parameters(root: Path, manifest: Manifest) -> dict[str, str]:
    """Plan and plugin library paths of a TensorRT engine, checked to exist now, not at load."""
    backend = manifest.backend
    plan = root / (backend.plan or "model.plan")
    if not plan.is_file():
        raise UserError(f"TensorRT engine {root} has no plan file {plan.name}", "rebuild the engine")
    plugins = []
    for entry in backend.plugins:
        lib = root / entry.file
        if not lib.is_file():
            raise UserError(f"plugin library {entry.file} named by {root}/build.json is missing",
                            "rebuild the engine, or copy the plugin library back into the engine directory")
        plugins.append(str(lib.resolve()))
    return {"TRT_PLAN": str(plan.resolve()), "TRT_PLUGINS": ",".join(plugins)}


def _place_engine(src: Path, manifest: Manifest, dst: Path) -> None:
    """Copy exactly the files `manifest` lists, plus build.json, from the verified engine `src` to `dst`.

    The engine directory is untrusted input: nothing is found by walking it, and no symbolic link is
    followed. Each file is reached from `src` one directory at a time with O_NOFOLLOW (a directory
    swapped for a link after `verify` fails here), must be a regular file of the listed size, and
    its copy must be of that same file (a file swapped in between the check and the copy is
    refused)."""
    root_fd = _open_dir(src, None, src)
    try:
        for rel in [*manifest.files, engine_dir.MANIFEST]:
            size = manifest.files[rel].size if rel in manifest.files else None
            *dirs, name = rel.split("/")
            parent_fd = os.dup(root_fd)
            try:
                for i, part in enumerate(dirs):  # one level at a time: a linked directory fails here
                    child_fd = _open_dir(part, parent_fd, src.joinpath(*dirs[:i + 1]))
                    os.close(parent_fd)
                    parent_fd = child_fd
                target = dst / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                _place_file(parent_fd, name, size, target, src / rel)
            finally:
                os.close(parent_fd)
    finally:
        os.close(root_fd)


def _open_dir(name: str | Path, dir_fd: int | None, shown: Path) -> int:
    """A directory fd for `name` (relative to `dir_fd`); a symbolic link is an EngineError."""
    try:
        return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as exc:
        raise EngineError(f"engine directory {shown} cannot be opened as a directory ({exc.strerror}; a symbolic "
                          "link is refused)", "rebuild the engine, and keep it unchanged while `triton` runs") from None


def _place_file(dir_fd: int, name: str, size: int | None, target: Path, shown: Path) -> None:
    """Copy the regular file `name` of `dir_fd` to `target`, never through a symlink. A copy, not a hard
    link: a file with two links is refused by onnx_ir when it loads external data (as a possible hard-link
    attack), which would break every later pass build from the engine and from its copy."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError as exc:
        raise EngineError(f"engine file {shown} cannot be read ({exc.strerror})", "rebuild the engine") from None
    if not stat.S_ISREG(st.st_mode) or (size is not None and st.st_size != size):
        expected = "a regular file" + (f" of {size} bytes" if size is not None else "")
        raise EngineError(f"engine file {shown} changed after it was verified (it is no longer {expected})",
                          "rebuild the engine, and keep it unchanged while `triton` runs")
    _copy_file(dir_fd, name, st, target, shown)


def _copy_file(dir_fd: int, name: str, st: os.stat_result, target: Path, shown: Path) -> None:
    """Copy through a file descriptor opened with O_NOFOLLOW, checked to be the file `st` describes."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as exc:
        raise EngineError(f"engine file {shown} cannot be read ({exc.strerror})", "rebuild the engine") from None
    with os.fdopen(fd, "rb") as source:
        opened = os.fstat(source.fileno())
        if (opened.st_dev, opened.st_ino) != (st.st_dev, st.st_ino) or not stat.S_ISREG(opened.st_mode):
            raise EngineError(f"engine file {shown} was replaced while it was being copied", "rebuild the engine")
        with open(target, "xb") as out:
            shutil.copyfileobj(source, out, 1 << 22)
    os.chmod(target, stat.S_IMODE(st.st_mode))
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))


def _is_model_written_here(path: Path) -> bool:
    """What `triton --force` may replace: a model directory this command wrote (its shim, unchanged)."""
    shim = path / "1" / "model.py"
    return (path / "config.pbtxt").is_file() and shim.is_file() and not shim.is_symlink() \
        and shim.stat().st_size < 1 << 16 and shim.read_text(errors="replace") == MODEL_SHIM


def write_model_repository(engine: str | Path, out_repo: str | Path, model_name: str = "enginesmith",
                           *, execution_env: str | Path | None = None, device: str = "auto",
                           threads: int = 0, workers: int = 1, copy_engine: bool = False,
                           verify_hashes: bool = True, max_tokens: int = DEFAULT_MAX_TOKENS,
                           special_tokens_in_text: bool = False, force: bool = False, max_batch: int = 0,
                           num_pages: int = 0, max_waiting: int = DEFAULT_MAX_WAITING,
                           gpus: Sequence[int] = (), engine_core: str = "auto") -> Path:
    """Write `<out_repo>/<model_name>/` for `engine`; return that model directory.

    The model directory is written atomically (nothing is left behind on failure); other models in
    `out_repo` are untouched. `execution_env` is the Python environment Triton's stub runs the
    model in (EXECUTION_ENV_PATH: a venv directory or a venv-pack tarball with enginesmith and
    numpy<2 installed); without it, the stub uses the first `python3` on the server's PATH.
    `max_batch`, `num_pages` and `max_waiting` size the scheduler loop of a paged engine (0: the
    engine's own, see ModelOptions), and `engine_core` says where it runs; `gpus` writes one instance
    group per GPU (module docstring).
    """
    engine = Path(engine).resolve()
    if not model_name or any(c in model_name for c in "/\\ \"'") or model_name.startswith("."):
        raise UserError(f"invalid model name {model_name!r}", "use letters, digits, '-' or '_'")
    if device not in ("auto", "cpu", "cuda"):
        raise UserError(f"unknown device {device!r}", "use auto, cpu or cuda")
    if workers < 1 or threads < 0 or max_tokens < 1:
        raise UserError("workers must be >= 1, threads >= 0 and max_tokens >= 1", "fix the values")
    if max_batch < 0 or max_waiting < 1 or num_pages < 0 or num_pages == 1:
        raise UserError(f"max_batch={max_batch}, num_pages={num_pages}, max_waiting={max_waiting}: the scheduler "
                        "needs max_batch >= 0, num_pages 0 or >= 2 and max_waiting >= 1 (0 = the engine's own)",
                        "fix the values")
    if engine_core not in PLACEMENTS:
        raise UserError(f"unknown engine core placement {engine_core!r}", f"use {', '.join(PLACEMENTS)}")
    gpus = tuple(gpus)
    if gpus and device == "cpu":
        raise UserError("GPU instance groups (gpus) were asked for a model that runs on the CPU",
                        "leave out --gpus, or use --device cuda (or auto)")
    manifest = engine_dir.verify(engine, hashes=verify_hashes)
    backend = manifest.backend.name
    if backend not in ("onnxruntime", "tensorrt"):
        raise UserError(f"engine {engine} is for backend {backend!r}, which the Triton model cannot serve",
                        "build it with `enginesmith build --backend ort` or `--backend trt`")
    options = ModelOptions(engine="1/engine" if copy_engine else str(engine), device=device,
                           threads=threads, workers=workers, verify_hashes=verify_hashes,
                           max_tokens=max_tokens, special_tokens_in_text=special_tokens_in_text,
                           max_batch=max_batch, num_pages=num_pages, max_waiting=max_waiting,
                           engine_core=engine_core)
    params = options.parameters()
    if backend == "tensorrt":
        params.update(_trt_parameters(engine, manifest))
        if copy_engine:  # point at the copies, relative to the version directory
            params["TRT_PLAN"] = "1/engine/" + (manifest.backend.plan or "model.plan")
            params["TRT_PLUGINS"] = ",".join("1/engine/" + e.file for e in manifest.backend.plugins)
    if execution_env is not None:
        env = Path(execution_env).resolve()
        if not (env.is_dir() and (env / "bin" / "python3").exists()) and not env.name.endswith((".tar.gz", ".tgz")):
            raise UserError(f"execution environment {env} is neither a venv directory nor a venv-pack tarball",
                            "create one with `python -m venv` and install enginesmith and numpy<2 into it")
        params["EXECUTION_ENV_PATH"] = str(env)
    out_repo = Path(out_repo)
    out_repo.mkdir(parents=True, exist_ok=True)
    target = out_repo / model_name
    with engine_dir.write_atomically(target, overwrite=force, replaceable=_is_model_written_here,
                                     kind="a model directory `enginesmith triton` wrote") as tmp:
        (tmp / "config.pbtxt").write_text(config_pbtxt(model_name, params, gpus))
        (tmp / "1").mkdir()
        (tmp / "1" / "model.py").write_text(MODEL_SHIM)
        if copy_engine:
            _place_engine(engine, manifest, tmp / "1" / "engine")
    return target


def parse_config(text: str) -> Any:
    """config.pbtxt -> ModelConfig protobuf (schema check; needs tritonclient[grpc])."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    return text_format.Parse(text, model_config_pb2.ModelConfig())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of the `triton` verb."""
    parser.add_argument("--engine", required=True, metavar="DIR", help="engine directory from `enginesmith build`")
    parser.add_argument("--out", required=True, metavar="REPO", help="Triton model repository (created if missing)")
    parser.add_argument("--name", default="enginesmith", help="model name in the repository (default enginesmith)")
    parser.add_argument("--env", metavar="VENV", default=None,
                        help="Python environment for the model (EXECUTION_ENV_PATH): a venv or venv-pack tarball "
                             "with enginesmith and numpy<2; default: the server's python3")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="ONNX Runtime device")
    parser.add_argument("--threads", type=int, default=0, help="intra-op threads (0 = all cores)")
    parser.add_argument("--workers", type=int, default=1,
                        help="engines without paged KV: requests generated at once, one per worker thread")
    parser.add_argument("--max-batch", type=int, default=0,
                        help="paged engines: rows per scheduler step (0 = the engine's own; CPU: 64)")
    parser.add_argument("--num-pages", type=int, default=0, help="paged engines: KV pages in the pool (0 = what fits)")
    parser.add_argument("--engine-core", choices=PLACEMENTS, default="auto",
                        help="a paged ONNX Runtime engine's scheduler and steps: in the model's stub process "
                             "(thread) or in an engine core process of its own (process), as `serve "
                             "--engine-core`; auto (default): process on a GPU, thread on the CPU")
    parser.add_argument("--max-waiting", type=int, default=DEFAULT_MAX_WAITING,
                        help="paged engines: requests queued before new ones get an UNAVAILABLE 'overloaded' error")
    parser.add_argument("--gpus", default=None, metavar="0,1",
                        help="one model instance (engine replica) per GPU named: instance_group KIND_GPU, gpus [i] "
                             "(default: none written; Triton then puts one instance on each GPU it sees)")
    parser.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help="default max_tokens per request")
    parser.add_argument("--copy-engine", action="store_true",
                        help="put copies of the engine's listed files inside the repository")
    parser.add_argument("--allow-special-tokens-in-text", action="store_true",
                        help="let request text spell control tokens such as <|im_start|> (default: encoded as "
                             "plain text, so clients cannot forge chat turns); only for trusted clients")
    parser.add_argument("--no-verify", action="store_true", help="skip hashing the engine files at model load")
    parser.add_argument("--force", action="store_true", help="replace an existing model of that name")


def run(args: argparse.Namespace) -> int:
    """The `triton` verb: write the model and print its directory. Bad input raises UserError."""
    model = write_model_repository(args.engine, args.out, args.name, execution_env=args.env, device=args.device,
                                   threads=args.threads, workers=args.workers, copy_engine=args.copy_engine,
                                   verify_hashes=not args.no_verify, max_tokens=args.max_tokens,
                                   special_tokens_in_text=args.allow_special_tokens_in_text, force=args.force,
                                   max_batch=args.max_batch, num_pages=args.num_pages, max_waiting=args.max_waiting,
                                   gpus=parse_gpus(args.gpus) if args.gpus is not None else (),
                                   engine_core=args.engine_core)
    if not is_paged(engine_dir.read_manifest(Path(args.engine))):
        print(f"note: {args.engine} has no paged KV cache: the model serves {args.workers} request(s) at a time "
              "(--workers); build the engine with --kv paged (GPU: --for-cuda --kv paged) for in-flight batching",
              file=sys.stderr)
    print(model)
    return 0
