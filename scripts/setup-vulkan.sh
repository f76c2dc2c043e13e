#!/usr/bin/env bash
# Creates or refreshes .venv-vulkan/: the set-up of setup.sh (test mode) over a Vulkan build
# of ggml, beside the CPU set-up in .venv/ (untouched). Installs what the build and Mesa's
# software Vulkan driver (lavapipe) need with apt, once; quick when already set up.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache="${DFLASH_CACHE:-$HOME/.cache/dflash-gguf}"
say() { echo "[setup-vulkan] $*" >&2; }
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

# glslc compiles ggml's shaders, spirv-headers they include; libvulkan-dev brings the loader
# the library links against, mesa-vulkan-drivers the lavapipe device the tests run on.
packages="glslc spirv-headers libvulkan-dev mesa-vulkan-drivers"
missing=""
for p in $packages; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing="$missing $p"
done
if [ -n "$missing" ]; then
  say "installing$missing"
  as_root apt-get update -q
  # shellcheck disable=SC2086
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $missing
fi

# Debian bookworm's Vulkan headers (1.3.239) predate VK_EXT_layer_settings, which ggml's
# Vulkan backend uses (headers 1.3.272+). Trixie's headers build against bookworm's loader,
# so only its libvulkan-dev package is fetched and unpacked into the cache; the trixie
# source exists just long enough to download it, pinned so nothing is ever installed from it.
headers_root="$cache/vulkan-headers"
headers=$(ls -d "$headers_root"/*/usr/include 2>/dev/null | sort -V | tail -n 1 || true)
if [ -z "$headers" ] || [ ! -f "$headers/vulkan/vulkan.hpp" ]; then
  say "fetching Vulkan headers from Debian trixie's libvulkan-dev"
  list=/etc/apt/sources.list.d/dflash-trixie-headers.sources
  pin=/etc/apt/preferences.d/dflash-trixie-headers
  work=$(mktemp -d)
  drop_trixie() {
    as_root rm -f "$list" "$pin"
    as_root apt-get update -q >/dev/null || true
    rm -rf "$work"
  }
  trap drop_trixie EXIT
  printf 'Types: deb\nURIs: http://deb.debian.org/debian\nSuites: trixie\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
    | as_root tee "$list" >/dev/null
  printf 'Package: *\nPin: release n=trixie\nPin-Priority: 1\n' | as_root tee "$pin" >/dev/null
  as_root apt-get update -q -o Dir::Etc::sourcelist="$list" -o Dir::Etc::sourceparts=- \
    -o APT::Get::List-Cleanup=0 >/dev/null
  chmod 777 "$work"
  (cd "$work" && as_root apt-get download -q libvulkan-dev/trixie)
  deb=$(ls "$work"/libvulkan-dev_*.deb)
  version=$(dpkg-deb -f "$deb" Version)
  mkdir -p "$headers_root/$version"
  dpkg-deb -x "$deb" "$headers_root/$version"
  headers="$headers_root/$version/usr/include"
  drop_trixie
  trap - EXIT
fi

DFLASH_VENV="$root/.venv-vulkan" CMAKE_ARGS="-DGGML_VULKAN=ON -DVulkan_INCLUDE_DIR=$headers" \
  bash "$root/scripts/setup.sh" test
