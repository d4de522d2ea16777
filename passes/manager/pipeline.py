"""Run a pipeline of passes over an ONNX file: verify after every pass, write the result atomically.

    src.onnx ─ pass 1 ─ save ─ check ─ [compare with previous: exact passes] ─ pass 2 ─ ... ─ dst.onnx

Each intermediate graph is saved (weights in external data) into a work directory next to `dst`
(or into `dump_dir`, where it stays), checked by the ONNX checker and strict shape inference, and,
for exact passes, compared with the graph before the pass on sample inputs; a mismatch stops the
pipeline. The model is reloaded from what was saved, so untouched weights stay lazily mapped and
RAM holds only what passes change. `dst` (+ `dst.data`) appears only when every pass succeeded.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import time
from pathlib import Path

import onnx_ir as ir

from enginesmith.core.errors import UserError
from enginesmith.core.progress import say
from enginesmith.passes.machinery.edit import drop_unused_initializers
from enginesmith.passes.machinery.registry import PassContext, Step
from enginesmith.passes.manager import verify
from enginesmith.passes.manager.steps import calibrated_steps, parse_pipeline, passes


def _data(path: Path) -> Path:
    return path.with_name(path.name + ".data")


def save(model: ir.Model, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    ir.save(model, path, external_data=_data(path).name)
    if not _data(path).exists():  # keep the (onnx, data) pair layout even with no big tensors
        _data(path).write_bytes(b"")


def _commit(final: Path, dst: Path, keep_source: bool) -> None:
    """Move (or copy, when `final` must stay) the graph and its data to `dst`, data first."""
    for src_file, dst_file in ((_data(final), _data(dst)), (final, dst)):
        if keep_source:
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=dst.parent)
            os.close(fd)
            shutil.copyfile(src_file, tmp)
            os.replace(tmp, dst_file)
        else:
            os.replace(src_file, dst_file)


def run_pipeline(src: str | os.PathLike, dst: str | os.PathLike, steps: list[Step] | str,
                 calibration=None, dump_dir: str | os.PathLike | None = None, progress: bool = True,
                 verify_exact: bool = True) -> list[dict]:
    """Apply `steps` to the graph `src` and write `dst`; returns one report dict per pass:
    name, params, exact, counts, skipped (node, reason), details, max_diff, tolerance, seconds."""
    src, dst = Path(src), Path(dst)
    if isinstance(steps, str):
        steps = parse_pipeline(steps)
    table = passes()
    if not src.is_file():
        raise UserError(f"graph {str(src)!r} does not exist", "export the model first")
    if src.resolve() == dst.resolve():
        raise UserError("the pipeline's output would overwrite its input", "write to another path")
    needing = [s.name for s in calibrated_steps(steps)]
    if needing and calibration is None:
        raise UserError(f"passes {', '.join(needing)} need calibration data",
                        "pass a calibration set (calibrate.calibration_set)")
    dst.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".passes-", dir=dst.parent))
    dumps = Path(dump_dir) if dump_dir is not None else None
    report: list[dict] = []
    try:
        current, model = src, ir.load(src)
        for i, step in enumerate(steps, 1):
            info = table[step.name]
            _say(progress, f"[{i}/{len(steps)}] {step.spec()}")
            start = time.perf_counter()
            exact = info.is_exact(step.params)
            result = info.fn(model, step.params, PassContext(current, calibration, progress))
            drop_unused_initializers(model.graph)
            out = (dumps or work) / f"{i:02d}-{step.name}" / dst.name
            save(model, out)
            model = None  # free the pass's new arrays before the verifier loads graphs into ORT
            verify.check_graph(out)
            entry = {"name": step.name, "params": dataclasses.asdict(step.params), "exact": exact,
                     "counts": result.counts, "skipped": [r.to_json() for r in result.skipped],
                     "details": result.details, "max_diff": None, "tolerance": None}
            if exact and verify_exact:
                cmp = verify.compare(current, out)
                if cmp is not None:
                    entry.update(max_diff=cmp.max_diff, tolerance=cmp.tolerance)
                    if not cmp.ok:
                        raise verify.PassCheckError(
                            f"exact pass {step.spec()} changed the logits by {cmp.max_diff:.3g} "
                            f"(tolerance {cmp.tolerance:.3g}, |logits| up to {cmp.scale:.3g})")
            entry["seconds"] = round(time.perf_counter() - start, 3)
            report.append(entry)
            model = ir.load(out)  # re-anchor untouched weights to the file just written
            if current != src and dumps is None:
                shutil.rmtree(current.parent, ignore_errors=True)
            current = out
        _commit(current, dst, keep_source=current == src or dumps is not None)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return report


def _say(progress: bool, text: str) -> None:
    if progress:
        say(text)  # beside the build's bar, not glued onto it
