#!/usr/bin/env bash
# Renders an fsdp-sim HTML report in headless Chromium (Debian's chromium package) and saves a
# screenshot, to check that the report displays without network access.
#   tools/render-report.sh [report.html] [out.png]
# With no report given it simulates llama-2-7b on 8 x h100-sxm first.
set -euo pipefail
cd "$(dirname "$0")/.."
report=${1:-}
png=${2:-build/report.png}
if ! command -v chromium >/dev/null 2>&1; then
  echo "render-report: installing chromium" >&2
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >&2
fi
if [ -z "$report" ]; then
  ./fsdpkit build
  report=build/report.html
  build/fsdp-sim --model llama-2-7b --gpus 8 --seq-len 2048 --report "$report" >/dev/null
fi
chromium --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size=1320,760 \
  --screenshot="$png" "file://$(realpath "$report")" >/dev/null 2>&1
[ -s "$png" ] || { echo "render-report: no screenshot written" >&2; exit 1; }
echo "$png"
