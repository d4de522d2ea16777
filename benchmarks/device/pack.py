"""Pack the staged parts (`../shared/device/stage.py` writes them to .device/parts) into as few device calls
as the limits allow: one folder per call, `.device/b1`, `.device/b2`, ..., each holding hard links to its
parts (a folder is one carry path; a call carries at most 8 paths and 64 MiB with the working tree).

    python3 benchmarks/device/pack.py [--cap-mib 56] [--first NAME ...]

Parts of the files named by --first (a prefix of the file name) go into the first folders: what the first
calls' commands need. Prints each call's carry list and command prefix. Stdlib only.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / ".device"
PREFIX = "mkdir -p .device/parts && cp -n .device/b*/* .device/parts/ && bash .device/assemble.sh"


def pack(parts: list[Path], cap: int, first: tuple[str, ...]) -> list[list[Path]]:
    """First-fit, largest first within each group (the --first files, then the rest): the --first parts land
    in the earliest folders; the rest fill the room left there, then new folders."""
    def group(p: Path) -> int:
        return 0 if any(p.name.startswith(f) for f in first) else 1

    bins: list[list[Path]] = []
    sizes: list[int] = []
    for part in sorted(parts, key=lambda p: (group(p), -p.stat().st_size)):
        size = part.stat().st_size
        if size > cap:
            raise SystemExit(f"pack: {part.name} is {size >> 20} MiB, over the cap of {cap >> 20} MiB")
        for i in range(len(bins)):
            if sizes[i] + size <= cap:
                bins[i].append(part)
                sizes[i] += size
                break
        else:
            bins.append([part])
            sizes.append(size)
    return bins


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cap-mib", type=int, default=56, help="parts per call (the working tree takes the rest of 64)")
    ap.add_argument("--first", nargs="*", default=[], help="file name prefixes whose parts go first")
    args = ap.parse_args()
    manifest = json.loads((ROOT / "manifest.json").read_text())
    parts = [ROOT / "parts" / p for entry in manifest.values() for p in entry["parts"]]
    if missing := [p.name for p in parts if not p.is_file()]:
        raise SystemExit(f"pack: {len(missing)} part(s) missing under {ROOT / 'parts'}: stage again")
    for old in ROOT.glob("b[0-9]*"):
        shutil.rmtree(old)
    bins = pack(parts, args.cap_mib << 20, tuple(args.first))
    for i, bin_ in enumerate(bins, 1):
        folder = ROOT / f"b{i}"
        folder.mkdir()
        for part in bin_:
            os.link(part, folder / part.name)
        mib = sum(p.stat().st_size for p in bin_) / (1 << 20)
        carry = [".device/assemble.sh", ".device/manifest.json", f".device/b{i}"]
        print(f"call {i}: {len(bin_)} part(s), {mib:.1f} MiB; carry {json.dumps(carry)}")
    print(f"each call's command starts with: {PREFIX}")


if __name__ == "__main__":
    main()
