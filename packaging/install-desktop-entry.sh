#!/usr/bin/env bash
# Adds kvscope to the desktop's application menu for the current user, launching the app from
# this checkout's .venv (run ./dev setup first). Undo with: install-desktop-entry.sh --remove
# (The frozen bundle's tarball has its own install.sh: packaging/install.sh.)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
id=io.github.kvscope.kvscope
apps="${XDG_DATA_HOME:-$HOME/.local/share}/applications"
icons="${XDG_DATA_HOME:-$HOME/.local/share}/icons/hicolor/scalable/apps"
if [ "${1:-}" = "--remove" ]; then
  rm -f "$apps/$id.desktop" "$icons/$id.svg"
  exit 0
fi
[ -x "$root/.venv/bin/kvscope" ] || { echo "run ./dev setup first" >&2; exit 1; }
mkdir -p "$apps" "$icons"
cp "$root/assets/kvscope.svg" "$icons/$id.svg"
sed "s|^Exec=kvscope|Exec=\"$root/.venv/bin/kvscope\"|" "$root/assets/$id.desktop" > "$apps/$id.desktop"
if command -v desktop-file-validate >/dev/null; then desktop-file-validate "$apps/$id.desktop"; fi
echo "installed $apps/$id.desktop"
