"""The engine directory: what a build writes and the only thing the runtime loads.

    <engine>/model.onnx, model.onnx.data      the final graph
    <engine>/tokenizer/...                    tokenizer files (and chat template)
    <engine>/build.json                       source, passes, precision, KV layout, backend,
                                              and sha256 + size of every other file

Engines travel between machines and into Triton repositories, so a directory is untrusted input.
`verify` is the one loader, and it checks before anything is parsed:
  1. build.json is a regular file of at most 1 MiB, UTF-8 JSON, valid against manifest.parse
     (every path it names relative, normalized and inside);
  2. the directory holds only directories and regular files: no symbolic links at all (inside or
     out), no FIFOs, sockets or devices, and no file that build.json does not list;
  3. every listed file has its listed size, then its listed sha256 (opened with O_NOFOLLOW);
  4. (for ONNX Runtime and the passes) the graph parses, and its external-data references name
     files of the directory.

`write_atomically` builds into a temp directory beside the target under a per-target lock and
renames it into place, so an interrupted or concurrent build never leaves a half-written engine.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import json
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Callable, Iterator

from enginesmith.core import interrupts
from enginesmith.core import manifest as schema
from enginesmith.core.errors import EngineError, UserError
from enginesmith.core.manifest import FORMAT_VERSION, Manifest  # noqa: F401  (re-exported)
from enginesmith.core.out_paths import check_new_file, check_out
from enginesmith.core.paths import cache_dir, writing_to

MANIFEST = "build.json"
MAX_MANIFEST_BYTES = 1 << 20
MAX_GRAPH_PROTO_BYTES = 2 << 30      # protobuf's own limit: weights live in external data
MAX_DEPTH = 8


# ----------------------------------------------------------------------------- hashing

def sha256(path: Path, size: int | None = None) -> str:
    """sha256 of a regular file, opened without following a symlink; with `size`, read no more."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0))
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise EngineError(f"{path} is not a regular file", "engines hold only regular files")
        h = hashlib.sha256()
        left = size if size is not None else -1
        while left != 0:
            block = f.read(1 << 22 if left < 0 else min(left, 1 << 22))
            if not block:
                break
            h.update(block)
            left -= len(block) if left > 0 else 0
    return h.hexdigest()


def _walk(root: Path) -> dict[str, int]:
    """Regular files under root (relative posix path -> size), build.json excluded; anything else
    (a symlink, FIFO, socket, device, too deep or too many entries) is an EngineError."""
    found: dict[str, int] = {}

    def visit(directory: Path, prefix: str, depth: int) -> None:
        if depth > MAX_DEPTH:
            raise EngineError(f"{root} nests directories deeper than {MAX_DEPTH}", "rebuild the engine")
        with os.scandir(directory) as entries:
            for entry in entries:
                rel = f"{prefix}{entry.name}"
                st = entry.stat(follow_symlinks=False)
                if stat.S_ISLNK(st.st_mode):
                    raise EngineError(f"{root} holds a symbolic link {rel!r}; engine directories hold only regular "
                                      "files", f"remove {root / rel} or rebuild the engine")
                if stat.S_ISDIR(st.st_mode):
                    visit(Path(entry.path), rel + "/", depth + 1)
                elif stat.S_ISREG(st.st_mode):
                    if rel != MANIFEST:
                        found[rel] = st.st_size
                else:
                    raise EngineError(f"{root} holds {rel!r}, which is not a regular file (a FIFO, socket or device)",
                                      f"remove {root / rel} or rebuild the engine")
                if len(found) > schema.MAX_FILES:
                    raise EngineError(f"{root} holds more than {schema.MAX_FILES} files", "rebuild the engine")

    visit(root, "", 0)
    return found


# ----------------------------------------------------------------------------- reading

def rebuild_fix(root: Path, raw: object = None) -> str:
    """The command that rebuilds the engine at `root` (from build.json's source when it is readable)."""
    root = Path(root)
    with contextlib.suppress(OSError, ValueError):
        if root.resolve().is_relative_to((cache_dir() / "engines").resolve()):
            return f"delete it (rm -r {root}); the cached engine is rebuilt on the next run"
    source = raw.get("source") if isinstance(raw, dict) else None
    path = source.get("path") if isinstance(source, dict) else None
    model = f" --model {path}" if isinstance(path, str) and path and "\n" not in path else ""
    return f"rebuild it: enginesmith build{model} --out {root} --force"


def _root(root: Path) -> Path:
    root = Path(root)
    try:
        st = os.stat(root)
    except FileNotFoundError:
        raise EngineError(f"engine directory {root} does not exist", "run `enginesmith build` to create it") from None
    except OSError as exc:
        raise EngineError(f"engine directory {root} cannot be read ({exc.strerror})", "check the path") from None
    if not stat.S_ISDIR(st.st_mode):
        raise EngineError(f"{root} is a file, not an engine directory",
                          "pass the directory `enginesmith build --out` wrote")
    return root


def _read_raw(root: Path) -> object:
    """build.json of `root`, decoded, after checking it is a small regular file."""
    path = root / MANIFEST
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise EngineError(f"{root} has no {MANIFEST}: not an engine directory or an incomplete build",
                          rebuild_fix(root)) from None
    if not stat.S_ISREG(st.st_mode):
        raise EngineError(f"{path} is not a regular file (a symlink or special file)", rebuild_fix(root))
    if st.st_size > MAX_MANIFEST_BYTES:
        raise EngineError(f"{path} is {st.st_size} bytes, more than a build.json holds ({MAX_MANIFEST_BYTES})",
                          rebuild_fix(root))
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as f:
            data = f.read(MAX_MANIFEST_BYTES + 1)
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise EngineError(f"{path} is not UTF-8 text", rebuild_fix(root)) from None
    except json.JSONDecodeError as exc:
        raise EngineError(f"{path} is not valid JSON ({exc.msg}, line {exc.lineno})", rebuild_fix(root)) from None
    except RecursionError:
        raise EngineError(f"{path} nests JSON too deeply", rebuild_fix(root)) from None
    except OSError as exc:
        raise EngineError(f"{path} cannot be read ({exc.strerror})", rebuild_fix(root)) from None


def read_manifest(root: Path) -> Manifest:
    """build.json of `root`, validated (no file is hashed): enough to decide how to open it."""
    root = _root(root)
    raw = _read_raw(root)
    try:
        return schema.parse(raw)
    except schema.ManifestError as exc:
        raise EngineError(f"{root}/{MANIFEST}: {exc.what}", rebuild_fix(root, raw)) from None


def foreign_entries(root: Path, owned: set[str], limit: int = 10_000) -> list[str]:
    """Entries under `root` (relative posix paths) that are not in `owned`: a file not listed, a folder
    holding nothing owned, a symlink, FIFO, socket or device of any name. Folders are not followed
    through links. At most `limit` entries are looked at; beyond that the rest counts as foreign."""
    keep_dirs = {parent.as_posix() for rel in owned for parent in Path(rel).parents if parent.as_posix() != "."}
    foreign: list[str] = []
    seen = 0

    def visit(directory: Path, prefix: str) -> None:
        nonlocal seen
        with os.scandir(directory) as entries:
            for entry in sorted(entries, key=lambda e: e.name):
                seen += 1
                rel = f"{prefix}{entry.name}"
                if seen > limit:
                    foreign.append(f"(more than {limit} entries)")
                    return
                st = entry.stat(follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode) and rel in keep_dirs and rel.count("/") < 4 * MAX_DEPTH:
                    visit(Path(entry.path), rel + "/")
                elif not (stat.S_ISREG(st.st_mode) and rel in owned):
                    foreign.append(rel + ("/" if stat.S_ISDIR(st.st_mode) else ""))

    visit(Path(root), "")
    return foreign


def refuse_foreign(root: Path, foreign: list[str], kind: str) -> None:
    """The one refusal of `--force` over files enginesmith did not write, with their list."""
    if foreign:
        shown = ", ".join(foreign[:8]) + (f" and {len(foreign) - 8} more" if len(foreign) > 8 else "")
        raise UserError(f"{root} holds files that are not part of {kind} ({shown}); --force replaces only what "
                        "enginesmith wrote", "move those files away, or choose another --out")


def looks_like_engine(path: Path) -> bool:
    """What `build --force` may replace: an engine directory whose build.json this enginesmith reads
    (of any format; a build.json without a graph among its files, such as a two-key {"format_version",
    "files"}, is not one) holding nothing but the files build.json lists
    (missing ones may be missing: an altered engine is rebuilt). Anything else there is a UserError
    listing it: --force never deletes a file enginesmith did not write."""
    try:
        raw = _read_raw(_root(path))
    except EngineError:
        return False
    files = raw.get("files") if isinstance(raw, dict) else None
    # any format (an older engine is replaceable too), but a real one: a graph among its listed files
    if not (isinstance(raw.get("format_version"), int) and isinstance(files, dict) and files
            and all(isinstance(k, str) for k in files) and isinstance(raw.get("graph"), str) and raw["graph"] in files):
        return False
    refuse_foreign(path, foreign_entries(path, set(files) | {MANIFEST}), "the engine its build.json lists")
    return True


def verify(root: Path, backend_check: Callable[[Manifest], None] | None = None, hashes: bool = True,
           onnx_graph: bool = False) -> Manifest:
    """The one loader: build.json validated, the directory's files confined, regular, listed, of the
    listed sizes and (with `hashes`) hashes; with `onnx_graph` (every caller that hands the graph to
    ONNX Runtime or a pass), the graph parses and its external data are files of the directory.
    Returns the manifest."""
    root = _root(root)
    manifest = read_manifest(root)
    fix = rebuild_fix(root, manifest.raw)
    present = _walk(root)
    for rel, record in manifest.files.items():
        if rel not in present:
            raise EngineError(f"engine file {rel} is missing from {root}", fix)
        if present[rel] != record.size:
            raise EngineError(f"engine file {rel} in {root} was altered ({present[rel]} bytes, build.json lists "
                              f"{record.size})", fix)
    extra = sorted(set(present) - set(manifest.files))
    if extra:
        raise EngineError(f"{root} holds files build.json does not list: {', '.join(extra[:5])}",
                          f"remove them, or {fix}")
    if hashes:
        for rel, record in manifest.files.items():
            if sha256(root / rel, record.size) != record.sha256:
                raise EngineError(f"engine file {rel} in {root} was altered (sha256 mismatch)", fix)
    if onnx_graph:
        _check_graph(root, manifest, fix)
    if backend_check:
        backend_check(manifest)
    return manifest


def _check_graph(root: Path, manifest: Manifest, fix: str) -> None:
    """The graph parses as ONNX and every external-data location is a file the manifest lists."""
    import onnx  # deferred on purpose: a TensorRT-only or manifest-only caller never needs it
    from google.protobuf.message import DecodeError

    if manifest.files[manifest.graph].size > MAX_GRAPH_PROTO_BYTES:
        raise EngineError(f"{root / manifest.graph} is larger than an ONNX protobuf may be", fix)
    try:
        # the bytes as protobuf, as ONNX Runtime reads them: onnx picks a JSON or text parser by the file's
        # extension otherwise (a "graph": "x.json" raised its ParseError)
        model = onnx.load(str(root / manifest.graph), format="protobuf", load_external_data=False)
    except (DecodeError, ValueError, RuntimeError, OSError, RecursionError) as exc:
        raise EngineError(f"{root / manifest.graph} is not a valid ONNX model ({type(exc).__name__})", fix) from None
    for tensor in _tensors(model.graph):
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        location = next((e.value for e in tensor.external_data if e.key == "location"), "")
        try:
            rel = schema.check_relative_path(location, f"external data of {tensor.name}")
        except schema.ManifestError:
            rel = None
        if rel is None or (str(Path(manifest.graph).parent / rel).removeprefix("./") not in manifest.files):
            raise EngineError(f"{root / manifest.graph} reads tensor {tensor.name!r} from {location!r}, which is not "
                              "a file of the engine directory", fix)


def _tensors(graph) -> Iterator:
    yield from graph.initializer
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            if attr.HasField("g"):
                yield from _tensors(attr.g)
            for g in attr.graphs:
                yield from _tensors(g)


# ----------------------------------------------------------------------------- writing

def write_manifest(root: Path, fields: dict) -> Manifest:
    """Hash every file under `root` into build.json with `fields`; the result is validated."""
    root = Path(root)
    files = {rel: {"sha256": sha256(root / rel), "size": size} for rel, size in sorted(_walk(root).items())}
    raw = dict(fields, format_version=FORMAT_VERSION, files=files)
    try:
        manifest = schema.parse(json.loads(json.dumps(raw)))
    except schema.ManifestError as exc:  # our own bug: never write a manifest the loader refuses
        raise RuntimeError(f"refusing to write an invalid build.json: {exc}") from None
    (root / MANIFEST).write_text(json.dumps(raw, indent=2, sort_keys=False) + "\n")
    return manifest


def output_errors(target: Path) -> contextlib.AbstractContextManager:
    """A block writing `target` or its temp siblings: a read-only or full filesystem, no permission
    or a path under /proc become one UserError line (paths.writing_to, the one place for that)."""
    target = Path(target)
    return writing_to(target.parent, target.name,
                      fix="choose an --out on a writable file system with enough free space")


@contextlib.contextmanager
def lock(target: Path, wait: bool) -> Iterator[None]:
    """An exclusive fcntl lock for writing `target` (a hidden lock file beside it, removed on
    release): `wait` blocks until the other writer is done, else another writer is a UserError."""
    target = Path(target)
    lock_path = target.with_name(f".{target.name}.lock")
    with output_errors(target):
        target.parent.mkdir(parents=True, exist_ok=True)
    while True:
        with output_errors(target):
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            os.close(fd)
            raise UserError(f"another build is writing {target}",
                            "wait for it to finish, or choose another --out") from None
        try:  # the holder before us may have removed the file: then this lock guards nothing
            same = os.stat(lock_path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.unlink(lock_path)  # before the lock is released, so a waiter sees it is gone
        os.close(fd)


def _remove_stale(target: Path) -> None:
    """Temp and old directories of earlier writers of `target` (dead: we hold its lock)."""
    for prefix in (f".{target.name}.tmp-", f".{target.name}.old-"):
        for stale in target.parent.glob(f"{glob.escape(prefix)}*"):
            if stale.is_dir() and not stale.is_symlink():
                shutil.rmtree(stale, ignore_errors=True)
            else:
                stale.unlink(missing_ok=True)


@contextlib.contextmanager
def write_atomically(target: Path, overwrite: bool = False, wait: bool = False,
                     replaceable: Callable[[Path], bool] = looks_like_engine,
                     kind: str = "an enginesmith engine", locked: bool = False) -> Iterator[Path]:
    """Yield a temp dir to fill; on success it replaces `target`, on any failure (an exception,
    Ctrl-C, SIGTERM) it is removed. Writers of one target exclude each other (`wait`: block, else
    fail at once; `locked`: the caller holds `lock(target)` already); `overwrite` replaces only a
    directory that `replaceable` accepts."""
    target = check_out(target, "--out", "dir")  # '', '.', '/', a file's child, a name too long for temp names
    with contextlib.ExitStack() as stack:
        if not locked:
            stack.enter_context(lock(target, wait))
        _check_target(target, overwrite, replaceable, kind)
        stack.enter_context(interrupts.as_exceptions())
        with output_errors(target):
            _remove_stale(target)
            tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.tmp-{os.getpid()}-"))
        try:
            with output_errors(target):
                yield tmp
            interrupts.raise_pending()  # a signal whose exception something swallowed: publish nothing
            with output_errors(target):
                if os.path.lexists(target):
                    old = target.with_name(f".{target.name}.old-{os.getpid()}")
                    os.replace(target, old)
                    os.replace(tmp, target)
                    shutil.rmtree(old, ignore_errors=True)
                else:
                    os.replace(tmp, target)
        except BaseException:  # KeyboardInterrupt and SIGTERM included: leave nothing half-written
            shutil.rmtree(tmp, ignore_errors=True)
            raise


def _check_target(target: Path, overwrite: bool, replaceable: Callable[[Path], bool], kind: str) -> None:
    if not os.path.lexists(target):
        return
    if not overwrite:
        raise UserError(f"{target} already exists", "pass --force to replace it or choose another --out")
    if target.is_symlink() or not target.is_dir():
        raise UserError(f"{target} is not a directory, and --force replaces only {kind}",
                        "remove it yourself or choose another --out")
    if not replaceable(target):
        raise UserError(f"{target} is not {kind}, and --force replaces only {kind}",
                        "remove it yourself or choose another --out")


@contextlib.contextmanager
def graph_pair_atomically(out: Path, force: bool) -> Iterator[Path]:
    """Yield a temp path `<tmpdir>/<out.name>` to write a graph and its `<name>.data` into; on success
    both move into place (data first, so the graph that appears reads data that is there), under a
    lock beside `out`. The graph's data reference is `<name>.data`, the final name, because the temp
    graph has the final name in a temp folder. On any failure nothing of ours is left."""
    flag = "--out"
    out = check_out(out, flag, "file")
    data = out.with_name(out.name + ".data")
    check_out(data, flag + " (its .data file)", "file")
    with lock(out, wait=False):
        for p in (out, data):
            check_new_file(p, flag, force)
        with output_errors(out):
            tmpdir = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-{os.getpid()}-"))
        try:
            with output_errors(out):
                yield tmpdir / out.name
            interrupts.raise_pending()
            for p in (out, data):  # again: another program may have put something there meanwhile
                check_out(p, flag, "file")
                check_new_file(p, flag, force)
            with output_errors(out):
                written_data = tmpdir / data.name
                if not written_data.exists():
                    written_data.write_bytes(b"")  # a graph with no external tensors: keep the pair's layout
                os.replace(written_data, data)
                os.replace(tmpdir / out.name, out)
        finally:
            shutil.rmtree(tmpdir, ignore_errors=True)
