#!/usr/bin/env bash
# The checkout laid out as the installed package: a copy of the tree in which every folder that
# pyproject.toml's [tool.setuptools.package-dir] maps into enginesmith (export/ -> enginesmith/export/, ...)
# is moved to where the package has it. Tools that read structure from imports (an `import
# enginesmith.passes` is a file under enginesmith/passes/) cannot follow package-dir; on this copy
# they can. docs/architecture.md says what it is for.
#
#   tools/package_view.sh DEST [SOURCE]
#
# SOURCE: a checkout (this one if left out). DEST: a new directory (refused if it exists and is not
# empty). The copy holds the files git tracks or would track (.gitignore'd ones, .venv, build outputs
# left out), as they are in the work tree, uncommitted edits included; it is made a git repository
# (files staged, nothing committed) so that tools that list files through git see them. Nothing in
# SOURCE changes.
set -euo pipefail

if [[ $# -lt 1 || $# -gt 2 || "$1" == -h || "$1" == --help ]]; then
    sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi
DEST="$1"
SOURCE="$(cd "${2:-$(dirname "$0")/..}" && pwd)"
[[ -f "$SOURCE/pyproject.toml" ]] || { echo "package_view: no pyproject.toml in $SOURCE" >&2; exit 1; }
if [[ -e "$DEST" && -n "$(ls -A "$DEST" 2>/dev/null)" ]]; then
    echo "package_view: $DEST exists and is not empty; name a new directory" >&2
    exit 1
fi
mkdir -p "$DEST"
DEST="$(cd "$DEST" && pwd)"

# the files: tracked and untracked-not-ignored, present in the work tree
(cd "$SOURCE" && git ls-files -z --cached --others --exclude-standard) \
    | (cd "$SOURCE" && while IFS= read -r -d '' f; do [[ -f "$f" || -L "$f" ]] && printf '%s\0' "$f"; done) \
    | (cd "$SOURCE" && tar --null --no-recursion -T - -cf -) \
    | tar -xf - -C "$DEST"

# "package" = "folder" pairs of [tool.setuptools.package-dir]; the root package's own line is skipped
python3 - "$DEST" <<'EOF'
import re
import sys
from pathlib import Path

dest = Path(sys.argv[1])
text = (dest / "pyproject.toml").read_text()
try:
    import tomllib
    mapping = tomllib.loads(text).get("tool", {}).get("setuptools", {}).get("package-dir", {})
except ImportError:  # Python 3.10: the section's `"a" = "b"` lines
    section = re.search(r"^\[tool\.setuptools\.package-dir\]\n(.*?)(?=^\[|\Z)", text, re.M | re.S)
    mapping = dict(re.findall(r'^"([^"]+)"\s*=\s*"([^"]+)"', section.group(1), re.M)) if section else {}
for package, folder in sorted(mapping.items()):
    target = Path(*package.split("."))
    if Path(folder) == target:
        continue
    if not (dest / folder).is_dir():
        sys.exit(f"package_view: pyproject maps {package} to {folder}/, which is not in the copy")
    if (dest / target).exists():
        sys.exit(f"package_view: {target}/ exists already; {folder}/ cannot move there")
    (dest / target).parent.mkdir(parents=True, exist_ok=True)
    (dest / folder).rename(dest / target)
    print(f"{folder}/ -> {target.as_posix()}/")
EOF

git -C "$DEST" init -q
git -C "$DEST" add -A
echo "package view of $SOURCE in $DEST"
