#!/usr/bin/env bash
# Builds the manual in docs/ as a site into site/ (gitignored) with MkDocs in strict mode (mkdocs.yml): a broken
# internal link or anchor, or a page missing from the nav, fails the build. Installs the pinned `docs` extra into
# .venv (or $VLLM_MEM_VENV) first, once: a second run with pyproject.toml unchanged only builds.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${VLLM_MEM_VENV:-.venv}"
[ -x "$venv/bin/python" ] || "${PYTHON:-python3}" -m venv "$venv"
stamp="$venv/.vllm-mem-docs-stamp"
want="$(sha1sum pyproject.toml | cut -c1-12)"
if ! { [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$venv/bin/python" -c "import mkdocs" 2>/dev/null; }; then
  echo "docs: installing pytest-vllm-mem[docs] into $venv" >&2
  # This machine's pip config lists local mirror folders that exist only for some packages; drop pip's warning
  # about each one it does not find there, keep its real errors.
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -e ".[docs]" \
    2> >(grep -v "^WARNING: Location '.*' is ignored" >&2)
  echo "$want" > "$stamp"
fi
"$venv/bin/python" -m mkdocs build --strict --clean --site-dir site "$@"
