#!/bin/sh
# Hostile inputs that need a file made at test time (issue 21's classes 2 and 3):
#   hostile.sh deep PLAN       60,000 nested arrays in a read key: one line, exit 2, no crash
#   hostile.sh utf8 PLAN SIM   a path that is not UTF-8 in --json / --trace output: valid JSON, exit 0
set -u
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
case $1 in
  deep)
    python3 -c "print('{\"model_type\":\"llama\",\"hidden_size\":' + '['*60000 + ']'*60000 + '}')" > "$dir/deep.json"
    "$2" --model "$dir/deep.json" > "$dir/out" 2> "$dir/err"; code=$?
    [ $code -eq 2 ] || fail "exit $code, expected 2"
    [ "$(wc -l < "$dir/err")" -eq 1 ] || fail "expected one line on stderr, got: $(head -c 300 "$dir/err")"
    grep -q "deep.json:1:164: JSON nested deeper than 128 levels" "$dir/err" || fail "message: $(cat "$dir/err")"
    ;;
  utf8)
    bad=$(printf "$dir/model-\377")
    mkdir "$bad" && cp "$(dirname "$0")/../../models/tiny-llama.json" "$bad/config.json"
    "$2" --model "$bad" --gpus 2 --json > "$dir/plan.json" || fail "fsdp-plan --json exit $?"
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); assert d['model']['id'] == 'model-\ufffd', d['model']['id']" "$dir/plan.json" \
      || fail "fsdp-plan --json is not JSON with the id's bad byte replaced"
    trace=$(printf "$dir/trace-\377.json")
    "$3" --model "$bad" --gpus 2 --json --trace "$trace" > "$dir/sim.json" || fail "fsdp-sim exit $?"
    python3 -c "import json,sys; json.load(open(sys.argv[1])); json.load(open(sys.argv[2]))" "$dir/sim.json" "$trace" \
      || fail "fsdp-sim's --json or --trace is not JSON"
    ;;
  *) fail "unknown case $1" ;;
esac
echo ok
