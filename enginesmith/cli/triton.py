"""`enginesmith triton`: a Triton Inference Server model repository for an engine.

The flags and the work live in serving.triton_repository (which also runs as a script); this module
puts them under the `enginesmith` command, after the checks of what the command writes: --out is a
folder (created if missing), --name one plain path component that config.pbtxt can hold, and
--force replaces only a model directory whose every file this command wrote (its config, its shim,
and with --copy-engine the engine's listed files): anything else there is refused, with the list."""

from __future__ import annotations

import os
from pathlib import Path

from enginesmith.core import engine_dir
from enginesmith.core.errors import EngineError, UserError
from enginesmith.core.out_paths import MAX_NAME, check_out
from enginesmith.serving import triton_repository

WRITTEN = {"config.pbtxt", "1/model.py"}   # what write_model_repository puts in a model directory
COPIED_ENGINE = "1/engine"                 # and where --copy-engine puts the engine


def add_parser(verbs) -> None:
    p = verbs.add_parser("triton", help="write a Triton Inference Server model repository for an engine")
    triton_repository.add_arguments(p)
    p.set_defaults(func=cmd_triton)


def check_model_name(name: str) -> None:
    """--name: printable, no path or quote characters, not hidden, short enough for temp names."""
    bad = [c for c in name if not c.isprintable() or c in "/\\ \"'"]
    if not name or bad or name.startswith(".") or len(os.fsencode(name)) > MAX_NAME:
        shown = f"{name[:40]!r}" + ("..." if len(name) > 40 else "")
        raise UserError(f"invalid --name {shown}: a model name is 1 to {MAX_NAME} printable characters without "
                        "spaces, quotes, slashes or a leading dot", "use letters, digits, '-' or '_'")


def check_force(target: Path) -> None:
    """Refuse --force over a model directory holding files this command did not write (listing them)."""
    if not target.is_dir() or target.is_symlink() or not triton_repository._is_model_written_here(target):
        return  # nothing there, or not ours at all: write_model_repository refuses it with its own line
    owned = set(WRITTEN)
    copied = target / COPIED_ENGINE
    if copied.is_dir() and not copied.is_symlink():
        try:
            files = engine_dir.read_manifest(copied).files
            owned |= {f"{COPIED_ENGINE}/{rel}" for rel in files} | {f"{COPIED_ENGINE}/{engine_dir.MANIFEST}"}
        except EngineError:
            pass  # an engine copy we cannot read: its files count as foreign
    engine_dir.refuse_foreign(target, engine_dir.foreign_entries(target, owned),
                              "the model `enginesmith triton` wrote")


def cmd_triton(args) -> int:
    repo = check_out(args.out, "--out", "dir")
    check_model_name(args.name)
    if args.force:
        check_force(repo / args.name)
    return triton_repository.run(args)
