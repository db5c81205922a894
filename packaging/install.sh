#!/usr/bin/env bash
# Installs the unpacked kvscope bundle for the current user, or removes it again.
#
#   ./install.sh [--prefix DIR]            the app into DIR/lib/kvscope (default ~/.local), the
#                                          `kvscope` command into DIR/bin, and the desktop entry,
#                                          icon and AppStream metainfo into the XDG data folder
#                                          ($XDG_DATA_HOME, default DIR/share)
#   ./install.sh --remove [--prefix DIR]   removes exactly those; conversations and settings
#                                          (in kvscope's data and config folders) are kept
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
id=io.github.kvscope.kvscope
prefix="$HOME/.local"
remove=0
while [ $# -gt 0 ]; do
  case "$1" in
    --remove) remove=1 ;;
    --prefix) [ $# -ge 2 ] || { echo "install.sh: --prefix needs a folder" >&2; exit 2; }; prefix="$2"; shift ;;
    -h|--help) sed -n '2,9p' "$0"; exit 0 ;;
    *) echo "install.sh: unknown option $1 (--prefix DIR, --remove)" >&2; exit 2 ;;
  esac
  shift
done
case "$prefix" in /*) ;; *) prefix="$(pwd)/$prefix" ;; esac
share="${XDG_DATA_HOME:-$prefix/share}"
app="$prefix/lib/kvscope"
bin="$prefix/bin/kvscope"
files=(
  "$share/applications/$id.desktop"
  "$share/metainfo/$id.metainfo.xml"
  "$share/icons/hicolor/scalable/apps/$id.svg"
)

refresh_caches() {
  # Desktops read these caches; both tools are optional (the files work without them).
  if command -v update-desktop-database >/dev/null; then update-desktop-database -q "$share/applications" || true; fi
  if command -v gtk-update-icon-cache >/dev/null; then gtk-update-icon-cache -q -t "$share/icons/hicolor" 2>/dev/null || true; fi
}

if [ "$remove" -eq 1 ]; then
  rm -f "${files[@]}"
  # Only a link this script made, and only a folder that holds the kvscope bundle.
  if [ -L "$bin" ]; then rm -f "$bin"; fi
  if [ -x "$app/kvscope" ] && [ -d "$app/_internal" ]; then rm -rf "$app"; fi
  refresh_caches
  echo "removed kvscope from $prefix (conversations and settings are kept)"
  exit 0
fi

[ -x "$here/kvscope/kvscope" ] || { echo "install.sh: run it from the unpacked kvscope folder (no kvscope/kvscope beside it)" >&2; exit 1; }
mkdir -p "$prefix/lib" "$prefix/bin" "$share/applications" "$share/metainfo" "$share/icons/hicolor/scalable/apps"
rm -rf "$app.new"
cp -a "$here/kvscope" "$app.new"
rm -rf "$app"
mv "$app.new" "$app"
ln -sfn "$app/kvscope" "$bin"
cp "$here/share/metainfo/$id.metainfo.xml" "$share/metainfo/"
cp "$here/share/icons/hicolor/scalable/apps/$id.svg" "$share/icons/hicolor/scalable/apps/"
# The launcher names the installed binary by its full path (quoted: it may hold spaces), as a menu
# does not read ~/.bashrc's PATH.
sed "s|^Exec=kvscope|Exec=\"$app/kvscope\"|" "$here/share/applications/$id.desktop" > "$share/applications/$id.desktop"
refresh_caches
echo "installed kvscope into $app; run $bin, or find kvscope in the application menu"
case ":$PATH:" in *":$prefix/bin:"*) ;; *) echo "note: $prefix/bin is not on your PATH" ;; esac
